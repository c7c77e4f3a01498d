"""What confines a VMM process on the host: seccomp, an unprivileged user, read-only template files,
and a tie to the service's life.

A device-emulation bug lets a hostile guest run code as its QEMU process. That process must then
hold nothing worth having:
- `-sandbox` (seccomp) with spawn, privilege elevation, resource control and obsolete calls denied;
- the uid/gid of a dedicated system user (`VM_USER`) with no groups and no_new_privs, so no file of
  root's (the App key, the webhook secret, the state directory) is readable or writable;
- every file it needs is opened by the host and handed over as a descriptor (`/proc/self/fd/N`
  or `fd=N`): the VM user needs no path into the state directory, which stays root's 0700;
- the template's RAM is a sealed memfd (no writes, no growth, seals sealed): QEMU 7.2 opens a
  `memory-backend-file` read-write even for a private mapping, so handing it the template file
  itself would hand it a writable template. A sealed memfd still maps privately copy-on-write.
- a parent-death signal (SIGKILL) so that no guest outlives the service that supervises it.

The parent-death signal fires when the *thread* that forked the VMM ends, and a uid change
clears it; so VMMs are forked by one long-lived thread (`Spawner`), and the signal is set by a
second `setpriv` that already runs as the VM user, just before it execs QEMU.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import queue
import shutil
import struct
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from runner.vm.errors import VMError

VM_USER = "microvm-check-vm"
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_COPY_CHUNK = 1 << 20

T = TypeVar("T")


@dataclass(frozen=True)
class VMUser:
    name: str
    uid: int
    gid: int


def vm_user(create: bool = True) -> VMUser:
    """The unprivileged user VMMs run as; created as a system user on first use (as scripts/setup does)."""
    try:
        entry = pwd.getpwnam(VM_USER)
    except KeyError:
        if not create:
            raise VMError(f"the VM user {VM_USER!r} does not exist: run scripts/setup (or useradd --system {VM_USER})") from None
        _create_user()
        entry = pwd.getpwnam(VM_USER)
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise VMError(f"the VM user {VM_USER!r} has uid/gid 0: it must be an unprivileged system user")
    return VMUser(VM_USER, entry.pw_uid, entry.pw_gid)


def _create_user() -> None:
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    proc = subprocess.run(
        [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
         "--shell", "/usr/sbin/nologin", VM_USER],
        capture_output=True, text=True,
    )
    # exit status 9: another process created it a moment ago, which is just as good
    if proc.returncode not in (0, 9):
        raise VMError(f"could not create the VM user {VM_USER!r}: {proc.stderr.strip()}")


def drop_prefix(user: VMUser | None) -> list[str]:
    """argv prefix: become `user` (if given), then arm the parent-death signal and exec the VMM.

    The second setpriv already runs with the final credentials, so the signal survives (a uid
    change would clear it)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise VMError("setpriv is not installed: apt-get install util-linux")
    prefix = []
    if user is not None:
        prefix = [setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--no-new-privs",
                  "--inh-caps=-all", "--bounding-set=-all", "--"]
    return [*prefix, setpriv, "--pdeathsig", "KILL", "--"]


def proc_fd(fd: int) -> str:
    """The path by which a process reaches its own descriptor `fd` (kept across exec by pass_fds)."""
    return f"/proc/self/fd/{fd}"


def open_tap(tap: str) -> int:
    """Open the existing tap `tap` of the calling thread's network namespace; the fd is QEMU's `-netdev tap,fd=`.

    Opened here, as root, so the VMM needs neither CAP_NET_ADMIN nor to own the tap."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifreq = struct.pack("16sH", tap.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifreq)
    except OSError as exc:
        os.close(fd)
        raise VMError(f"cannot attach to tap {tap}: {exc}") from None
    return fd


def sealed_copy(path: Path) -> int:
    """A memfd holding `path`'s bytes, sealed against any write, resize or further sealing.

    Holes and all-zero chunks are skipped, so the copy only costs the template's used RAM."""
    src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    fd = os.memfd_create(f"template:{path.parent.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        size = os.fstat(src).st_size
        os.ftruncate(fd, size)
        for start, end in _data_ranges(src, size):
            _copy_range(src, fd, start, end)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.close(src)
    return fd


def _data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    ranges, offset = [], 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left
            break
        end = os.lseek(fd, start, os.SEEK_HOLE)
        ranges.append((start, end))
        offset = end
    return ranges


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    zero = bytes(_COPY_CHUNK)
    offset = start
    while offset < end:
        chunk = os.pread(src, min(_COPY_CHUNK, end - offset), offset)
        if not chunk:
            raise VMError(f"template RAM file shrank while being read (at {offset})")
        if chunk != zero[: len(chunk)]:
            os.pwrite(dst, chunk, offset)
        offset += len(chunk)


class Spawner:
    """One long-lived thread that forks every VMM, so their parent-death signal fires only when the
    service itself dies (it fires when the forking thread ends, not the process)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="vmm-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed back to the caller
                future.set_exception(exc)

    def run(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        self._jobs.put((fn, future))
        return future.result()


_spawner: Spawner | None = None
_spawner_lock = threading.Lock()


def spawner() -> Spawner:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = Spawner()
        return _spawner
