"""Uids of a fixed range, each leased to one confined process tree for as long as it lives.

Two things on a host run untrusted code as a uid of their own: each VMM (runner.vm.jail, `VM_UIDS`)
and each fleet runner (runner.fleet, `RUNNER_UIDS`). A uid of one's own is what keeps one of them
from reading, signalling or tracing another (/proc/PID/environ, ptrace and kill all check the uid).
The ranges lie outside what useradd (< 60000) and /etc/subuid (100000 + 65536 n, by default far
below) hand out, so no passwd entry is needed; `taken` lists accounts that sit in a range anyway
(doctor warns about them, and `lease` skips them).

A lease is an flock on `<leases>/<uid>`: free across every process of the host, released by
`UidLease.close` once whatever ran as the uid is gone, or by the kernel when the leaseholder dies.
"""

from __future__ import annotations

import fcntl
import os
import pwd
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner.errors import MicrovmCheckError

# "mv" = 0x6d76: VMs take the first 4096 uids of the block, runners the next 4096.
VM_UIDS = range(0x6D760000, 0x6D760000 + 4096)
RUNNER_UIDS = range(0x6D761000, 0x6D761000 + 4096)
LEASES = Path("/run/microvm-check")


@dataclass
class UidLease:
    """A uid held while its process tree lives; `close` releases it (idempotent)."""

    uid: int
    _fd: int

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class UidRange:
    """One range of uids and the directory of its lock files (root's, 0700)."""

    uids: range
    leases: Path
    what: str  # "VM", "runner": for messages

    def lease(self, exhausted: Callable[[str], MicrovmCheckError],
              usable: Callable[[int], bool] = lambda uid: True) -> UidLease:
        """The lowest uid not leased by anyone on this host and `usable`; `exhausted(message)` is raised
        when there is none."""
        self.leases.mkdir(mode=0o700, parents=True, exist_ok=True)
        for uid in self.uids:
            fd = os.open(self.leases / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if usable(uid):
                return UidLease(uid, fd)
            os.close(fd)
        raise exhausted(f"all {len(self.uids)} {self.what} uids ({self.uids.start}-{self.uids.stop - 1}) are in use")

    def taken(self) -> list[str]:
        """Accounts whose uid lies in the range: whatever ran as a leased uid would share it with them."""
        return [f"{entry.pw_name} ({entry.pw_uid})" for entry in pwd.getpwall() if entry.pw_uid in self.uids]


VMS = UidRange(VM_UIDS, LEASES / "vm-uids", "VM")
RUNNERS = UidRange(RUNNER_UIDS, LEASES / "runner-uids", "runner")
