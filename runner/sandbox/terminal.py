"""A terminal session in a sandbox's VM (`Sandbox.terminal`): a program on a pty of its own in the guest,
typed input in, the terminal's output out, resize and signals, its exit status.

Why a class of its own beside `Sandbox.exec`: a session is a stream both ways with a life of its own
(the service hands one to an operator's `jobs attach`, the SDK's `terminal()`), so each of its calls
goes through the sandbox's error mapping: a broken channel destroys the VM and is a SandboxError, a
program that cannot start is a CommandNotStarted, and the sandbox (a job's VM) lives on when the
session ends."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from runner.vm.agent import ExecOutcome, GuestPty
from runner.vm.errors import AgentError

if TYPE_CHECKING:
    from runner.sandbox.sandbox import Sandbox


class Terminal:
    """`output()` and `close()` are for one thread; `write`, `resize`, `signal` and `end` for any."""

    def __init__(self, sandbox: Sandbox, pty: GuestPty) -> None:
        self._sbx = sandbox
        self._pty = pty

    @property
    def outcome(self) -> ExecOutcome | None:
        """The program's exit, once `output()` has ended (None: it was ended from here, or the VM went)."""
        return self._pty.outcome

    @property
    def input_dropped(self) -> int:
        """Typed bytes the guest dropped because the program did not read them (bounded there)."""
        return self._pty.input_dropped

    def output(self) -> Iterator[bytes]:
        """The terminal's output as it comes, until the program has ended (then `outcome` is set)."""
        chunks = self._pty.output()
        while True:
            chunk = self._sbx._call(lambda _agent: next(chunks, None))
            if chunk is None:
                return
            yield chunk

    def write(self, data: bytes) -> None:
        self._sbx._call(lambda _agent: self._pty.write(data))

    def resize(self, rows: int, cols: int) -> bool:
        return self._sbx._call(lambda _agent: self._pty.resize(rows, cols))

    def signal(self, name: str) -> bool:
        return self._sbx._call(lambda _agent: self._pty.signal(name))

    def end(self) -> None:
        self._sbx._call(lambda _agent: self._pty.end())

    def close(self) -> None:
        """The session ended in the guest and its streams closed; the sandbox runs on. Never raises for a
        VM that is already gone."""
        try:
            self._pty.close()
        except AgentError:
            pass  # the VM went meanwhile: its owner hears of it on its own calls
