"""The SDK's `terminal()` against a real `serve` on a real VM, as unprivileged users of the host (issue 37).

A bot in the config's `sandboxes.group` opens its sandbox's shell on a terminal: `tty` names a pty, a
resize reaches `stty size`, Ctrl-C typed into a `sleep` interrupts it, the exit status comes back, and
the sandbox lives on (an exec fed on stdin too); the asyncio SDK does the same, lighter. Another user of
the group, holding its own sandbox's token, is refused the bot's sandbox's terminal. Needs root, QEMU and
the built `base` template: failing under CI=true.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.jobapi.client import JobClient
from tests.e2e.test_vm_e2e_serve import serve  # noqa: F401 (fixture)
from tests.e2e.test_vm_sdk import BOT, PYTHON, facts, run_as
from tests.e2e.vm_jobs import templates, vm_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vm


@pytest.fixture
def bots() -> Iterator[tuple[str, str, int, int]]:
    """(socket group, sandbox group, a bot, another bot): both in both groups."""
    tag = secrets.token_hex(3)
    sock_group, sbx_group, bot, other = f"mvctk{tag}", f"mvctb{tag}", f"mvctbot{tag}", f"mvctoth{tag}"
    for group in (sock_group, sbx_group):
        subprocess.run(["groupadd", "--system", group], check=True)
    for user in (bot, other):
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--gid", sock_group,
                        "--groups", f"{sock_group},{sbx_group}", user], check=True)
    try:
        yield sock_group, sbx_group, pwd.getpwnam(bot).pw_uid, pwd.getpwnam(other).pw_uid
    finally:
        for user in (bot, other):
            subprocess.run(["pkill", "-KILL", "-u", user], check=False)
            subprocess.run(["userdel", user], check=False)
        for group in (sock_group, sbx_group):
            subprocess.run(["groupdel", group], check=False)


def test_a_bot_drives_a_terminal_in_its_sandbox_and_another_users_token_is_refused(
        serve, vm_root: Path, bots: tuple[str, str, int, int]) -> None:
    sock_group, sbx_group, bot, other = bots
    os.chmod(vm_root, 0o755)  # the users reach the socket in it (the state dir stays the service's)
    service = serve({"socket_group": sock_group, "sandboxes": {"group": sbx_group, "max_ttl_seconds": 600}})
    socket = vm_root / "api.sock"
    operator = JobClient(socket=str(socket))
    service.wait_answering(operator)

    account = pwd.getpwuid(bot)
    proc = subprocess.Popen([str(PYTHON), "-I", str(BOT), str(socket), "terminal"], user=bot, group=account.pw_gid,
                            extra_groups=os.getgrouplist(account.pw_name, account.pw_gid),
                            env={"PATH": "/usr/bin:/bin"}, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list[dict] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        while not lines or "ready" not in lines[-1]:
            line = proc.stdout.readline()
            assert line, f"the bot ended early: {lines} {proc.stderr.read() if proc.stderr else ''}"
            lines.append(json.loads(line))
        seen = facts(lines)
        intruded = facts([json.loads(line) for line in run_as(other, [str(PYTHON), "-I", str(BOT), str(socket),
                                                                      "intrude", seen["ready"]], 600).stdout.splitlines()])
        proc.stdin.write("done\n")
        proc.stdin.flush()
        assert proc.wait(300) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    assert seen["tty"].startswith("/dev/pts/"), seen
    assert seen["stty_size"] == "33 111", "the resize did not reach the terminal"
    assert seen["interrupted"] == "130", "Ctrl-C did not interrupt the sleep"
    assert (seen["exit_code"], seen["killed"], seen["timed_out"]) == (5, False, False), seen
    assert seen["alive"] == [0, "alive\n"], "the sandbox did not live on after its terminal"
    assert seen["stdin"] == "fed on stdin\n"
    assert seen["async_"]["exit_code"] == 3 and "/dev/pts/" in seen["async_"]["output"] \
        and "20 70" in seen["async_"]["output"], seen["async_"]
    assert intruded["intrude"] == 403, intruded

    record = operator.get(seen["ready"])
    assert record.state.value == "finished", record
    log = b"".join(e.data for e in operator.logs(seen["ready"]))
    assert b"terminal ended" in log and b"stty size" in log, log[-3000:]
    assert service.stop() == 0, service.stderr()
    assert "Traceback" not in service.stderr(), service.stderr()
