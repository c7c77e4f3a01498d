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
    _destroyed: bool = False
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
        return self._destroyed

    def destroy(self) -> None:
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
        if self.agent is not None:
            self.agent.close()
        self._killed_by_us = self.machine.alive()
        self.machine.kill()
        try:
            if self.slot is not None and self.slots is not None:
                self.slots.release(self.slot)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
