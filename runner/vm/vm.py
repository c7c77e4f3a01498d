"""One job's VM: its VMM process, agent channel, private directory and network slot.

`destroy()` is the single way out, idempotent and safe from any thread, and it is called on
every path: a normal end, an error, a TTL expiry, a dead VMM, a hostile guest.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runner.vm.agent import AgentClient
from runner.vm.hypervisor import Machine, Snapshot

if TYPE_CHECKING:
    from runner.net.slots import Slot, SlotPool


@dataclass
class VM:
    id: str
    dir: Path
    machine: Machine
    snapshot: Snapshot
    slot: Slot | None = None  # its network namespace, tap and filters when the VM has a network card
    slots: SlotPool | None = None  # where `slot` came from, and goes back to when the VM is destroyed
    agent: AgentClient | None = None
    ready_ms: float = 0.0
    expires_at: float = float("inf")  # time.monotonic() deadline (the TTL)
    failure: str | None = None  # why it was destroyed early, for the errors callers see
    checkout_drive_used: bool = False  # its CD-ROM holds a checkout, mounted for the VM's life
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ending: _Ending | None = None
    _killed_by_us: bool = False

    def fail(self, why: str) -> None:
        """Record why the VM is unusable (first reason wins) and destroy it."""
        with self._lock:
            if self.failure is None:
                self.failure = why
        self.destroy()

    def channel_broken(self, why: str) -> None:
        """The agent channel failed. A VMM that is dying closes the channel a moment before it can be
        reaped, so give it that moment: then the error can say the VMM died, not just that the
        channel closed."""
        deadline = time.monotonic() + 0.5
        while self.machine.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.fail(why)

    def describe_failure(self) -> str:
        code = self.machine.exit_status()
        if self.failure and code is not None and code < 0 and not self._killed_by_us:
            if code == -signal.SIGSYS:
                return f"{self.failure} (the VM's hypervisor process was killed by its seccomp sandbox: it made a forbidden system call)"
            return f"{self.failure} (the VM's hypervisor process was killed by signal {-code})"
        return self.failure or "the sandbox was destroyed"

    @property
    def destroyed(self) -> bool:
        return self._ending is not None

    def destroy(self) -> None:
        """Returns once the VM is gone, whichever thread ends it: a caller that finds another thread's
        destroy under way (the agent channel's reader, the engine's reaper) waits for it, since it may go
        on to free what the VM held (its engine, its state directory) the moment this returns."""
        with self._lock:
            ending, first = self._ending, self._ending is None
            if first:
                self._ending = ending = _Ending(threading.get_ident())
        assert ending is not None
        if not first:
            if ending.thread != threading.get_ident():  # the ending thread itself, re-entered, goes on
                ending.done.wait()
            return
        try:
            if self.agent is not None:
                self.agent.close()
            self._killed_by_us = self.machine.alive()
            self.machine.kill()
            if self.slot is not None and self.slots is not None:
                self.slots.release(self.slot)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            ending.done.set()


@dataclass
class _Ending:
    """A VM's destroy under way: the thread doing it, and set once it is done."""

    thread: int
    done: threading.Event = field(default_factory=threading.Event)
