"""A terminal in a real VM (issue 37): the guest agent's `pty` op through `Sandbox.terminal`.

A shell on a pty of its own: `tty` names it, it has the directory and environment it was given, a
resize reaches the program (SIGWINCH, `stty size`), Ctrl-C interrupts the foreground command and not
the shell, its exit status comes back, and what it left running ends with it while the sandbox lives
on. `exec(..., stdin=...)` gives a command its whole input, also one larger than any pipe holds that
the command never reads. Needs root, QEMU and the built `base` template: failing under CI=true.
"""

from __future__ import annotations

import hashlib
import queue
import re
import threading

import pytest

from runner.errors import CommandNotStarted, SandboxOpFailed

pytestmark = pytest.mark.vm

WAIT_S = 120.0  # a hang guard for each expected line, never a measure


class Screen:
    """What the terminal showed, read by a thread of its own, so a test can wait for a line."""

    def __init__(self, terminal) -> None:
        self.terminal = terminal
        self.seen = b""
        self._chunks: queue.Queue[bytes | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for chunk in self.terminal.output():
                self._chunks.put(chunk)
        finally:
            self._chunks.put(None)

    def expect(self, pattern: bytes) -> re.Match[bytes]:
        """Wait for `pattern` in what was shown after the last match; what comes after it is kept."""
        while (found := re.search(pattern, self.seen)) is None:
            try:
                chunk = self._chunks.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} in {WAIT_S:.0f} s; shown: {self.seen[-2000:]!r}") from None
            assert chunk is not None, f"the session ended before {pattern!r}: {self.seen[-2000:]!r}"
            self.seen += chunk
        self.seen = self.seen[found.end():]
        return found

    def ended(self) -> None:
        self._reader.join(WAIT_S)
        assert not self._reader.is_alive()


def test_a_terminal_session_has_a_tty_its_directory_and_environment_resizes_takes_ctrl_c_and_exits(sandbox):
    sandbox.exec(["mkdir", "-p", "/workspace/project"], cwd="/")
    terminal = sandbox.terminal(["/bin/bash", "--norc", "--noprofile", "-i"], cwd="/workspace/project",
                                env={"TERM": "dumb", "PS1": "$ ", "JOB_SETTING": "from-the-job"}, size=(30, 100))
    screen = Screen(terminal)
    try:
        terminal.write(b"echo T=$(tty) E=$JOB_SETTING D=$(pwd) S=$(stty size)\n")
        found = screen.expect(rb"T=(\S+) E=(\S+) D=(\S+) S=(\d+ \d+)")
        assert found.group(1).startswith(b"/dev/pts/"), found.group(0)
        assert found.groups()[1:] == (b"from-the-job", b"/workspace/project", b"30 100")

        assert terminal.resize(40, 132) is True
        terminal.write(b"echo R=$(stty size)\n")
        assert screen.expect(rb"R=(\d+ \d+)").group(1) == b"40 132"

        terminal.write(b"echo W=$((6*7)); sleep 1000\n")  # patterns only the output matches, not the typed echo
        screen.expect(rb"W=42")
        terminal.write(b"\x03")  # Ctrl-C, as a keyboard sends it: the terminal's line discipline signals
        terminal.write(b"echo I=$?\n")
        assert screen.expect(rb"I=(\d+)").group(1) == b"130", "Ctrl-C did not interrupt the command"
        terminal.write(b"echo A=$((1+1))\n")
        screen.expect(rb"A=2")  # the shell itself runs on

        terminal.write(b"sleep 2000 &\nexit 7\n")
        screen.ended()
    finally:
        terminal.close()
    assert terminal.outcome is not None and terminal.outcome.exit_code == 7
    left = sandbox.exec("pgrep -x sleep || echo none", cwd="/")
    assert left.stdout == b"none\n", "the session's background job outlived it"
    assert sandbox.alive and sandbox.exec("echo alive", cwd="/").stdout == b"alive\n"


def test_a_session_closed_by_the_host_ends_in_the_guest_and_the_sandbox_lives_on(sandbox):
    terminal = sandbox.terminal(["/bin/sh"], cwd="/", env={"PS1": "$ "})
    screen = Screen(terminal)
    terminal.write(b"echo S=$((2+3)); sleep 3000\n")
    screen.expect(rb"S=5")
    assert terminal.signal("TERM") is True  # to the foreground process group: sleep's, not the shell's
    terminal.write(b"echo T=$?; exit 3\n")
    assert screen.expect(rb"T=(\d+)").group(1) == b"143"
    screen.ended()
    terminal.close()
    assert terminal.outcome is not None and terminal.outcome.exit_code == 3
    assert sandbox.exec("pgrep -x sleep || echo none", cwd="/").stdout == b"none\n"

    second = sandbox.terminal(["/bin/sh"], cwd="/")
    Screen(second)
    second.close()  # from the host, while it runs: killed in the guest
    assert sandbox.exec("pgrep -x sh || echo none", cwd="/").stdout == b"none\n"
    assert second.resize(10, 10) is False, "a resize reached a session that has ended"


def test_a_terminal_that_cannot_start_says_why_and_the_sandbox_lives_on(sandbox):
    with pytest.raises(CommandNotStarted, match="no-such-program"):
        sandbox.terminal(["no-such-program"], cwd="/")
    with pytest.raises(CommandNotStarted, match="/no/such/dir does not exist"):
        sandbox.terminal(["/bin/sh"], cwd="/no/such/dir")
    assert sandbox.exec("echo alive", cwd="/").stdout == b"alive\n"


def test_exec_takes_its_whole_stdin_even_one_it_never_reads(sandbox):
    data = bytes(range(256)) * (12 * 1024)  # 3 MiB: more than a pipe, a frame or the agent's inbox holds
    assert sandbox.exec(["sha256sum"], cwd="/", stdin=data).stdout.split()[0] == \
        hashlib.sha256(data).hexdigest().encode()
    ignored = sandbox.exec(["true"], cwd="/", stdin=b"y" * (32 * 1024 * 1024))
    assert ignored.exit_code == 0
    assert sandbox.exec(["wc", "-c"], cwd="/", stdin=b"").stdout.strip() == b"0"
    assert sandbox.exec(["cat"], cwd="/").stdout == b"", "a command without stdin reads an empty one"
    assert sandbox.alive


def test_a_write_larger_than_the_agents_inbox_into_a_missing_directory_fails_and_the_sandbox_lives_on(sandbox):
    """The guest agent reads the rest of a refused write's data: unread, it filled the request's inbox
    (64 frames, 16 MiB) and stopped the agent's frame reader, and the sandbox died."""
    with pytest.raises(SandboxOpFailed, match="No such file or directory"):
        sandbox.files.write("/no/such/dir/big", b"x" * (32 * 1024 * 1024))
    assert sandbox.alive and sandbox.exec("echo alive", cwd="/").stdout == b"alive\n"
