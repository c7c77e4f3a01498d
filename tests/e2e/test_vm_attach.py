"""A terminal into a running job's VM through a real `serve` and the real CLI (issue 37).

A member of the config's `attach_group` runs `jobs exec` in a running job's VM: a tty, the job's working
directory and environment, the exit code, and the guest's OSC 52 clipboard write filtered out; a socket
member outside that group is refused (403). The operator attaches a shell from a terminal of its own
(a pty): a window resize reaches it, Ctrl-C interrupts its command, Ctrl-] detaches, and the job runs on
to its own end, its log saying who attached, its record listing the sessions and its transcript holding
what was typed and shown (inert: no escape sequence of the guest's). Needs root, QEMU and the built `base`
template: failing under CI=true.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import re
import secrets
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.jobapi.client import JobClient
from runner.service.jobs.joblog import shown_lines
from tests.e2e.test_vm_e2e_serve import serve  # noqa: F401 (fixture)
from tests.e2e.vm_jobs import submit, templates, vm_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vm
CLI = str(Path(sys.executable).parent / "microvm-check")
WAIT_S = 300.0  # hang guards, never measures
# released by a session's `touch`: the job's end (its VM destroyed) races that session's exit status, so the
# test waits on the job's end, not on the releasing session's answer
JOB = "echo ready; while [ ! -e /tmp/release ]; do sleep 0.2; done; echo released"


@pytest.fixture
def people() -> Iterator[tuple[str, str, int, int]]:
    """(socket group, attach group, a member of the attach group, an outsider): both may use the socket."""
    tag = secrets.token_hex(3)
    sock_group, attach_group, member, outsider = f"mvcas{tag}", f"mvcat{tag}", f"mvcdbg{tag}", f"mvcno{tag}"
    for group in (sock_group, attach_group):
        subprocess.run(["groupadd", "--system", group], check=True)
    for user, groups in ((member, f"{sock_group},{attach_group}"), (outsider, sock_group)):
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--gid", sock_group,
                        "--groups", groups, user], check=True)
    try:
        yield sock_group, attach_group, pwd.getpwnam(member).pw_uid, pwd.getpwnam(outsider).pw_uid
    finally:
        for user in (member, outsider):
            subprocess.run(["pkill", "-KILL", "-u", user], check=False)
            subprocess.run(["userdel", user], check=False)
        for group in (sock_group, attach_group):
            subprocess.run(["groupdel", group], check=False)


def cli_as(uid: int, args: list[str]) -> subprocess.CompletedProcess[bytes]:
    account = pwd.getpwuid(uid)
    return subprocess.run([CLI, *args], user=uid, group=account.pw_gid,
                          extra_groups=os.getgrouplist(account.pw_name, account.pw_gid), env={"PATH": "/usr/bin:/bin"},
                          cwd="/", capture_output=True, timeout=WAIT_S, stdin=subprocess.DEVNULL)


def running(client: JobClient, job: str) -> None:
    for entry in client.logs(job, follow=True):
        if entry.stream == "stdout" and b"ready" in entry.data:  # not the service's "VM … ready" note
            return
    raise AssertionError(f"job {job} ended before it was ready: {client.get(job)}")


class Pty:
    """The CLI on a terminal of the test's own: what it shows, and keys typed into it."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen([CLI, *args], stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.seen = b""

    def expect(self, pattern: bytes) -> re.Match[bytes]:
        deadline = time.monotonic() + WAIT_S
        while (found := re.search(pattern, self.seen)) is None:
            assert time.monotonic() < deadline, f"no {pattern!r} on the terminal: {self.seen[-2000:]!r}"
            try:
                self.seen += os.read(self.master, 65536)
            except OSError:
                raise AssertionError(f"the CLI ended before {pattern!r}: {self.seen[-2000:]!r}") from None
        self.seen = self.seen[found.end():]
        return found

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc.send_signal(signal.SIGWINCH)  # as the kernel does for a terminal's own session

    def close(self) -> int:
        code = self.proc.wait(WAIT_S)
        os.close(self.master)
        return code


def test_attach_and_exec_into_a_running_job_for_the_operator_and_the_attach_group_only(
        serve, vm_root: Path, people: tuple[str, str, int, int]) -> None:
    sock_group, attach_group, member, outsider = people
    os.chmod(vm_root, 0o755)
    sock = vm_root / "api.sock"
    service = serve({"socket_group": sock_group, "attach_group": attach_group, "max_concurrent_jobs": 1})
    operator = JobClient(socket=str(sock))
    service.wait_answering(operator)
    job = submit(operator, JOB, env={"GITHUB_REF_NAME": "attach-test"}, timeout_seconds=1200)
    running(operator, job)

    refused = cli_as(outsider, ["jobs", "exec", job, "--socket", str(sock), "--", "true"])
    assert refused.returncode == 1 and b"403" in refused.stderr and b"may not attach" in refused.stderr, refused

    ran = cli_as(member, ["jobs", "exec", job, "--socket", str(sock), "--", "sh", "-c",
                          r"tty; pwd; echo ref=$GITHUB_REF_NAME; printf '\033]52;c;cHduZWQ=\007shown\n'; exit 5"])
    assert ran.returncode == 5, ran
    assert re.search(rb"/dev/pts/\d+\r\n/workspace\r\nref=attach-test\r\nshown", ran.stdout), ran.stdout
    assert b"\x1b]52" not in ran.stdout and b"cHduZWQ" not in ran.stdout, "the guest wrote the operator's clipboard"

    shell = Pty(["jobs", "attach", job, "--socket", str(sock)])
    shell.expect(rb"/workspace# ")  # the shell's prompt, in the job's working directory: it reads what is typed
    shell.resize(33, 111)
    os.write(shell.master, b"echo S=$(stty size)\r")
    assert shell.expect(rb"S=(\d+ \d+)").group(1) == b"33 111"
    os.write(shell.master, b"echo W=$((6*7)); sleep 1000\r")
    shell.expect(rb"W=42")
    os.write(shell.master, b"\x03")
    os.write(shell.master, b"echo I=$?\r")
    assert shell.expect(rb"I=(\d+)").group(1) == b"130", "Ctrl-C did not interrupt the command in the VM"
    os.write(shell.master, b"\x1d")  # Ctrl-]: detach
    shell.expect(rb"detached from job")
    assert shell.close() == 0
    assert operator.get(job).state.value == "running", "detaching ended the job"

    cli_as(member, ["jobs", "exec", job, "--socket", str(sock), "--", "touch", "/tmp/release"])
    for _ in operator.logs(job, follow=True):
        pass
    record = operator.get(job)
    assert record.state.value == "finished" and record.exit_code == 0, record
    sessions = record.terminal_sessions
    assert [s["session"] for s in sessions] == [1, 2, 3], sessions  # the refused outsider never had one
    assert sessions[0]["who"].startswith(pwd.getpwuid(member).pw_name) and sessions[0]["ended"] == "its program exited 5"
    assert sessions[1]["argv"] == "/bin/bash -i" and sessions[1]["bytes_in"] > 0 and sessions[1]["ended_at"]
    shown = [(line.session, line.dir, line.text) for line in shown_lines(vm_root / "state" / "jobs" / job)]
    assert (1, "out", "shown") in shown and (2, "in", "echo W=$((6*7)); sleep 1000") in shown, shown
    assert not any("\x1b" in text for _, _, text in shown)
    assert not any("cHduZWQ" in text for _, direction, text in shown if direction == "out")  # the OSC 52 went whole
    log = b"".join(e.data for e in operator.logs(job))
    member_name = pwd.getpwuid(member).pw_name.encode()
    assert b"terminal session attached by " + member_name in log and b"released" in log
    assert service.stop() == 0, service.stderr()
    assert "Traceback" not in service.stderr(), service.stderr()
