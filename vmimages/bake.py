"""Bake one template variant: cold boot, warm up, quiesce, snapshot.

The snapshot is only as good as the moment it is taken: a guest still writing to its console
when it is stopped gives clones that take seconds to answer (docs/platform.md), so we wait until the
agent has answered, run the warm-up commands, sync, and leave it idle before `stop`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from runner.vm import guestwire
from runner.vm.agent import AgentClient, GuestMessage
from runner.vm.hypervisor import Hypervisor, Launch, MachineConfig, Snapshot
from vmimages.run import BuildError, run

BOOT_TIMEOUT_S = 300.0  # a cold boot under TCG on a busy 2-core machine
QUIESCE_S = 3.0


def bake(
    hv: Hypervisor,
    config: MachineConfig,
    pristine_disk: Path,
    variant_dir: Path,
    warmup: tuple[str, ...],
    say: Callable[[str], None],
    final_sync: bool = True,
) -> frozenset[str]:
    """Bake the variant into `variant_dir`; returns the operations its guest agent answers (the
    template's manifest records them: the host refuses a template whose agent lacks one it sends).

    `final_sync` runs `sync` in the guest before the snapshot, so clones start with nothing to write
    back; an image template skips it, because its commands run in the image, which may have no `sync`
    (a distroless image has not even a shell), and the snapshot is consistent without it (the
    guest's dirty pages are in the snapshot's memory and land in each clone's own overlay)."""
    variant_dir.mkdir(parents=True)
    disk = variant_dir / "disk.img"
    run(["cp", "--sparse=always", str(pristine_disk), str(disk)])
    bake_dir = variant_dir / "bake"
    bake_dir.mkdir()
    console_log = bake_dir / "console.log"
    launch = Launch(vm_dir=bake_dir, disk=disk, disk_format="raw", console_log=console_log)
    snapshot = Snapshot(config=config, mem_file=variant_dir / "mem.ram", state_file=variant_dir / "state.bin", disk=disk)
    machine = hv.boot(config, snapshot.mem_file, launch)
    agent = AgentClient(machine.agent)
    try:
        started = time.monotonic()
        try:
            pong = agent.ping(timeout=BOOT_TIMEOUT_S)
        except Exception as exc:
            console = console_log.read_text(errors="replace")[-1500:] if console_log.exists() else ""
            raise BuildError(f"the template never answered after a cold boot: {exc}\nconsole:\n{console}") from None
        say(f"cold boot to agent ready: {time.monotonic() - started:.1f} s")
        agent_ops = _agent_ops(pong)
        for command in (*warmup, *(("sync",) if final_sync else ())):
            outcome = agent.exec({"shell": command, "cwd": "/"}, lambda stream, data: None, timeout=120)
            if outcome.exit_code != 0:
                raise BuildError(f"warm-up command failed in the template (exit {outcome.exit_code}): {command}")
        time.sleep(QUIESCE_S)
        machine.snapshot(snapshot.state_file)
    finally:
        agent.close()
        machine.kill()
    shutil.rmtree(bake_dir)
    for path in (disk, snapshot.mem_file, snapshot.state_file):
        path.chmod(0o444)  # every clone maps these; nothing may ever write them again
    return agent_ops


def _agent_ops(pong: GuestMessage) -> frozenset[str]:
    """The operations the baked agent says it serves; all of those the host sends, or the build fails."""
    ops = pong.get("ops")
    answered = frozenset(op for op in ops if isinstance(op, str)) if isinstance(ops, list) else frozenset()
    lacking = guestwire.OPS - answered
    if lacking:
        raise BuildError(f"the template's guest agent does not serve {sorted(lacking)}: its root filesystem did not "
                         "get this checkout's vmimages/guest/agent.py")
    return answered
