"""Host-wide claims of slot pools: a prefix per pool, an uplink /30 per slot.

Two processes of ours may run slot pools on one host at once (`serve` beside `microvm-check run`, two
services with state directories of their own). Each namespace `prefix`-N and each outer veth end
exists once per host, and each slot's uplink address once per uplink namespace, so both are claimed
here, with an flock the kernel drops when the holder dies (nothing to clean after a crash):

- `claim_prefix`: one live pool per prefix. Its start-up sweep and its uplink's chains (named after
  the prefix) are then its own to remove; a second pool on the prefix is refused, naming the holder.
- `lease_index`: a slot index per uplink namespace (the root namespace for `HostUplink`). The index
  gives the slot's uplink /30 (`addresses.slot_network`), so pools of different prefixes on one
  uplink never put one address on two veths (two routes for one /30: replies would cross).
  A test's `NamespaceUplink` is a namespace of its own, so its indices start at 0 whatever runs beside it.

A lock file is removed by its holder on release (the claim dies with it); a taker that locked a file
removed meanwhile sees that it is no longer the one at the path and tries again.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass
from pathlib import Path

from runner.errors import NetworkError

LEASES = Path("/run/microvm-check/slots")
_SCOPE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


class PrefixTaken(NetworkError):
    """Another live process runs a slot pool with this prefix on this host."""


@dataclass
class Lease:
    """A held lock file; `release` removes it and drops the lock (idempotent)."""

    path: Path
    _fd: int

    def release(self) -> None:
        if self._fd < 0:
            return
        self.path.unlink(missing_ok=True)  # while still locked: no one holds a file that is no longer there
        os.close(self._fd)
        self._fd = -1


def claim_prefix(prefix: str, leases: Path = LEASES) -> Lease:
    """Hold `prefix` for this process's pool; PrefixTaken (naming the holder) when a live process holds it."""
    path = leases / f"prefix-{prefix}.lock"
    lease = _take(path, _describe_self())
    if lease is None:
        holder = _read(path) or "a process that has not written its name yet"
        raise PrefixTaken(
            f"network slot prefix {prefix!r} is in use on this host by {holder}: its namespaces {prefix}-N and "
            f"host chains MVC-{prefix.upper()}-* are that process's. Stop it, or give this service another "
            "network.slot_prefix in its config (1-9 lowercase letters/digits, starting with a letter)")
    return lease


def lease_index(scope: str | None, index: int, leases: Path = LEASES) -> Lease | None:
    """Hold slot `index` on the uplink namespace `scope` (None: the root namespace); None when it is held."""
    where = "root" if scope is None else "netns-" + _SCOPE_CHARS.sub("_", scope)
    return _take(leases / f"index-{where}-{index}.lock", _describe_self())


def _take(path: Path, note: str) -> Lease | None:
    """The exclusive lock of `path`, with `note` written in it; None when someone else holds it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _is_at(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, note.encode())
            return Lease(path, fd)
        os.close(fd)  # its holder released it (and removed the file) between our open and our lock


def _is_at(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _describe_self() -> str:
    """What a refused process is told about the holder: its pid and command line."""
    try:
        argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    command = " ".join(part.decode(errors="replace") for part in argv if part)[:300]
    return f"pid {os.getpid()} ({command or 'command line unknown'})"
