"""A bot on the host, run as an unprivileged user: it drives sandboxes of a running `serve` with the
client SDK (microvm_check) and prints one JSON line per fact the test checks.

argv: SOCKET MODE. Modes:
- tour: create, a streamed exec, files write/read/list, upload, download, a snapshot and a fork of it,
  each sandbox's token tried on the other, destroy;
- create: only try to create (a user outside the sandbox group is refused);
- hang: create with a short TTL, say so, then run a silent command until killed (kill -9 by the test);
- refusals: calls a sandbox cannot make, with the blocking and the asyncio SDK; then its VM powered off
  in the middle of an exec's output, and another's before any;
- takeover BASE: a guest that takes its agent over answers two downloads with members named
  BASE/victim.txt and ../victim2.txt, the second cut short; each tar is unpacked with plain tarfile
  into BASE/dest1 and BASE/dest2, as a trusting bot would;
- terminal: a sandbox's shell on a terminal (`tty`, a resize seen by `stty size`, Ctrl-C typed into a
  `sleep`, an exit status), the sandbox alive after it, an exec fed on stdin, the asyncio twin; then it
  says the sandbox's id and waits for a line on stdin before destroying it;
- intrude ID: create a sandbox of this user's own, and open sandbox ID's terminal with its token;
- hibernate: a sandbox with a file and a background process is hibernated (an exec meanwhile is refused),
  says `parked` and waits for a line on stdin (the test looks for its VM meanwhile), is resumed with the
  asyncio SDK, finds its file and process and the host's clock, and a second resume is refused; it says
  `back` and waits for a line again (the test counts its VMs) before it destroys the sandbox.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import sys
import tarfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from microvm_check import AsyncSandbox, Sandbox, SandboxError, Service, Terminal
from microvm_check.contract import SandboxInfo

TAKEOVER = Path(__file__).with_name("guest_takeover.py")


def say(**fact: object) -> None:
    print(json.dumps(fact), flush=True)


def tar_of(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def tour(service: Service) -> None:
    with Sandbox.create(ttl_seconds=300, service=service) as sbx:
        say(created=sbx.id, accel=sbx.info.accel, template=sbx.info.template, ttl_seconds=sbx.info.ttl_seconds)
        chunks: list[tuple[float, str, str]] = []
        result = sbx.exec("echo one; sleep 2; echo two >&2; exit 3", timeout=60, cwd="/",
                          on_output=lambda stream, data: chunks.append((time.monotonic(), stream, data.decode())))
        say(exit_code=result.exit_code, stdout=result.stdout.decode(), stderr=result.stderr.decode(),
            chunks=[[round(t - chunks[0][0], 2), s, d] for t, s, d in chunks])
        sbx.files.write("/workspace/notes.txt", b"written by the bot\n")
        say(read=sbx.files.read("/workspace/notes.txt").decode())
        sbx.upload(tar_of({"src/app.py": b"print('hi')\n", "README.txt": b"readme\n"}), dest="/workspace")
        say(listed=sorted(e.name for e in sbx.files.list("/workspace")))
        ran = sbx.exec("python3 src/app.py > out.txt; ls", timeout=60)
        say(ran=ran.exit_code, ls=ran.stdout.decode())
        tar = tarfile.open(fileobj=io.BytesIO(sbx.download("*.txt")))
        say(downloaded=sorted(tar.getnames()), out=tar.extractfile("out.txt").read().decode())
        with sbx.fork(ttl_seconds=300) as child:
            say(forked=child.id, fork_read=child.files.read("/workspace/notes.txt").decode(),
                fork_template=child.info.template, fork_base=child.info.base)
            for fact, sandbox_id, token in (("cross", child.id, sbx.token), ("cross_back", sbx.id, child.token)):
                try:  # the parent's token on the child, and back
                    Sandbox.connect(sandbox_id, token, service)
                    say(**{fact: "reached"})
                except SandboxError as exc:
                    say(**{fact: exc.status, f"{fact}_message": str(exc)})
            child.files.write("/workspace/notes.txt", b"changed in the fork\n")
        say(parent_read=sbx.files.read("/workspace/notes.txt").decode())
    say(destroyed=sbx.id)
    try:  # its own token, once the sandbox is gone
        Sandbox.connect(sbx.id, sbx.token, service)
        say(after_destroy="reached")
    except SandboxError as exc:
        say(after_destroy=exc.status)


def outcome(call: Callable[[], object]) -> dict[str, Any]:
    try:
        call()
    except SandboxError as exc:
        return {"status": exc.status, "message": str(exc)}
    return {"status": "made"}


async def outcome_async(call: Callable[[], Awaitable[object]]) -> dict[str, Any]:
    try:
        await call()
    except SandboxError as exc:
        return {"status": exc.status, "message": str(exc)}
    return {"status": "made"}


def fifo_tar() -> bytes:
    """A tar the service's header check passes and the host's unpacker refuses (a checkout holds no fifos)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        fifo = tarfile.TarInfo("pipe")
        fifo.type = tarfile.FIFOTYPE
        tar.addfile(fifo)
    return buffer.getvalue()


REFUSED = {  # what the sandbox cannot do -> the call, for a Sandbox or an AsyncSandbox
    "exec a missing program": lambda s: s.exec(["no-such-program"], timeout=60),
    "write into a missing directory": lambda s: s.files.write("/no/such/dir/f.txt", b"x"),
    # more than the guest agent's inbox holds: its reader must read the rest (issue 37)
    "write 32 MiB into a missing directory": lambda s: s.files.write("/no/such/dir/big", b"x" * (32 * 1024 * 1024)),
    "write onto a directory": lambda s: s.files.write("/workspace", b"x"),
    "write a 4096-character path": lambda s: s.files.write("/tmp/" + "n" * 4091, b"x"),
    "read a missing file": lambda s: s.files.read("/no/such/file"),
    "read a directory": lambda s: s.files.read("/workspace"),
    "upload a tar the host's unpacker refuses": lambda s: s.upload(fifo_tar()),
}


def refusals(service: Service) -> None:
    with Sandbox.create(ttl_seconds=300, service=service) as sbx:
        say(sync={what: outcome(lambda call=call: call(sbx)) for what, call in REFUSED.items()})
        say(async_=asyncio.run(refusals_async(service, sbx)))
        alive = sbx.exec("echo alive", timeout=60)
        say(alive=[alive.exit_code, alive.stdout.decode()])
        killer = Sandbox.connect(sbx.id, sbx.token, service)
        powered_off: list[threading.Thread] = []

        def power_off_once_output_came(stream: str, data: bytes) -> None:
            if not powered_off:  # the answer's head and first line are here: now the VM goes
                powered_off.append(threading.Thread(target=outcome, args=(
                    lambda: killer.exec(["sh", "-c", "echo o > /proc/sysrq-trigger"], timeout=60),)))
                powered_off[0].start()

        say(mid_stream=outcome(lambda: sbx.exec("echo going; sleep 600", timeout=600,
                                                on_output=power_off_once_output_came)))
        powered_off[0].join()
        killer._sender.close()
    with Sandbox.create(ttl_seconds=300, service=service) as quiet:
        say(before_output=outcome(lambda: quiet.exec("echo o > /proc/sysrq-trigger; sleep 600", timeout=600)))


async def refusals_async(service: Service, sbx: Sandbox) -> dict[str, Any]:
    same = await AsyncSandbox.connect(sbx.id, sbx.token, service)
    try:
        return {what: await outcome_async(lambda call=call: call(same)) for what, call in REFUSED.items()}
    finally:
        await same._sender.close()


def takeover(service: Service, base: Path) -> None:
    with Sandbox.create(ttl_seconds=300, service=service) as sbx:
        sbx.files.write("/tmp/takeover.py", TAKEOVER.read_bytes())
        taken = sbx.exec(["python3", "/tmp/takeover.py", str(base / "victim.txt")], timeout=120, cwd="/")
        say(takeover=[taken.exit_code, taken.stderr.decode()])
        downloads = [sbx.download("*", "../glob-escape.txt") for _ in range(2)]
    for n, data in enumerate(downloads, start=1):
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            say(**{f"members{n}": {m.name: dict(m.pax_headers) for m in tar}})
            trusting = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
            try:
                tar.extractall(base / f"dest{n}", **trusting)
                say(**{f"unpacked{n}": True})
            except OSError as exc:
                say(**{f"unpacked{n}": str(exc)})


def expect(term: Terminal, pattern: bytes, seen: list[bytes]) -> re.Match[bytes]:
    """Read the terminal until `pattern` matches what came since the last match (raw bytes, echo included)."""
    deadline = time.monotonic() + 120
    while (found := re.search(pattern, seen[0])) is None:
        chunk = term.read(timeout=max(0.1, deadline - time.monotonic()))
        if not chunk:
            raise AssertionError(f"the terminal ended before {pattern!r}: {seen[0][-2000:]!r}")
        seen[0] += chunk
    seen[0] = seen[0][found.end():]
    return found


def terminal(service: Service) -> None:
    with Sandbox.create(ttl_seconds=300, service=service) as sbx:
        seen = [b""]
        with sbx.terminal(rows=24, cols=80) as term:
            term.write("tty; echo T=done\n")
            say(tty=expect(term, rb"(/dev/pts/\d+)\r?\n", seen).group(1).decode())
            expect(term, rb"T=done", seen)
            term.resize(33, 111)
            term.write("echo S=$(stty size)\n")
            say(stty_size=expect(term, rb"S=(\d+ \d+)", seen).group(1).decode())
            term.write("echo W=$((6*7)); sleep 1000\n")
            expect(term, rb"W=42", seen)
            time.sleep(1)  # the sleep is the terminal's foreground job now
            term.write(b"\x03")  # Ctrl-C, as a keyboard types it
            time.sleep(0.5)  # after the line discipline flushed what was typed before it
            term.write("echo I=$?\n")
            say(interrupted=expect(term, rb"I=(\d+)", seen).group(1).decode())
            term.write("exit 5\n")
            end = term.wait(timeout=120)
            say(exit_code=end.exit_code, killed=end.killed, timed_out=end.timed_out)
        alive = sbx.exec("echo alive", timeout=60)
        say(alive=[alive.exit_code, alive.stdout.decode()])
        fed = sbx.exec(["cat"], timeout=60, stdin=b"fed on stdin\n")
        say(stdin=fed.stdout.decode())
        say(async_=asyncio.run(terminal_async(service, sbx)))
        say(ready=sbx.id)
        sys.stdin.readline()  # the test tried another user's token on it meanwhile


async def terminal_async(service: Service, sbx: Sandbox) -> dict[str, Any]:
    same = await AsyncSandbox.connect(sbx.id, sbx.token, service)
    try:
        async with await same.terminal(["sh", "-c", "tty; stty size; exit 3"], rows=20, cols=70) as term:
            output = b""
            async for chunk in term:
                output += chunk
            end = await term.wait(timeout=120)
        return {"output": output.decode(errors="replace"), "exit_code": end.exit_code}
    finally:
        await same._sender.close()


def intrude(service: Service, victim: str) -> None:
    with Sandbox.create(ttl_seconds=120, service=service) as mine:
        info = SandboxInfo(victim, "base", None, "running", "", None, 60.0, 60.0, None, None)
        other = Sandbox(service, info, mine.token)  # the victim's id with this user's own sandbox's token
        try:
            other.terminal(["true"]).close()
            say(intrude="reached")
        except SandboxError as exc:
            say(intrude=exc.status, message=str(exc))
        finally:
            other._sender.close()


def hibernate(service: Service) -> None:
    sbx = Sandbox.create(ttl_seconds=300, service=service)
    try:
        beat = "while :; do date +%s%N > /tmp/beat.new; mv /tmp/beat.new /tmp/beat; sleep 0.1; done"  # never empty
        started = sbx.exec(f"nohup sh -c '{beat}' >/dev/null 2>&1 & echo $!", timeout=60, cwd="/")
        sbx.files.write("/workspace/kept.txt", b"written before the hibernate\n")
        say(created=sbx.id, vm_id=sbx.info.vm_id, pid=started.stdout.decode().strip())
        sbx.hibernate()
        say(hibernated=sbx.info.state, parked_vm_id=sbx.info.vm_id)
        say(exec_while_parked=outcome(lambda: sbx.exec("true", timeout=60)))
        say(parked=True)
        sys.stdin.readline()  # the test looked for the VM meanwhile
        resumed = asyncio.run(_resume_async(sbx.id, sbx.token, service))
        say(resumed=resumed.info.state, resumed_vm_id=resumed.info.vm_id)
        back = Sandbox.connect(sbx.id, sbx.token, service)
        first = back.exec(f"cat /workspace/kept.txt; kill -0 {started.stdout.decode().strip()} && echo alive; "
                          "cat /tmp/beat", timeout=60, cwd="/")
        before = time.time()
        clock = back.exec("date +%s.%N", timeout=60, cwd="/")
        after = time.time()
        time.sleep(1)
        later = back.exec("cat /tmp/beat", timeout=60, cwd="/")
        lines = first.stdout.decode().split("\n")
        say(kept=lines[0], alive=lines[1], beat_moved=int(later.stdout) > int(lines[2]),
            clock=[before, float(clock.stdout), after])
        say(second_resume=outcome(lambda: Sandbox.resume(sbx.id, sbx.token, service)))
        say(back=True)
        sys.stdin.readline()  # the test counted the resumed sandbox's VMs meanwhile
        back._sender.close()
    finally:
        sbx.destroy()
    say(destroyed=sbx.id)


async def _resume_async(sandbox_id: str, token: str, service: Service) -> AsyncSandbox:
    resumed = await AsyncSandbox.resume(sandbox_id, token, service)
    await resumed._sender.close()
    return resumed


def main() -> None:
    socket, mode = sys.argv[1], sys.argv[2]
    service = Service(socket=socket)
    if mode == "tour":
        tour(service)
    elif mode == "create":
        try:
            Sandbox.create(ttl_seconds=60, service=service).destroy()
            say(create="allowed")
        except SandboxError as exc:
            say(create=exc.status, message=str(exc))
    elif mode == "refusals":
        refusals(service)
    elif mode == "terminal":
        terminal(service)
    elif mode == "intrude":
        intrude(service, sys.argv[3])
    elif mode == "hibernate":
        hibernate(service)
    elif mode == "takeover":
        takeover(service, Path(sys.argv[3]))
    elif mode == "hang":
        sbx = Sandbox.create(ttl_seconds=float(sys.argv[3]), service=service)
        say(created=sbx.id, vm_id=sbx.info.vm_id)
        sbx.exec("echo started; sleep 600", timeout=600, on_output=lambda stream, data: say(output=data.decode()))


if __name__ == "__main__":
    main()
