"""What confines a VMM process on the host: seccomp, an unprivileged user, read-only template files,
and a tie to the service's life.

A device-emulation bug lets a hostile guest run code as its QEMU process. That process must then
hold nothing worth having:
- `-sandbox` (seccomp) with spawn, privilege elevation, resource control and obsolete calls denied;
- a uid of its own, leased from `VM_UIDS` for the VMM's life (`lease_uid`), the gid of a dedicated
  system group (`VM_USER`), no supplementary groups and no_new_privs: no file of root's (the App
  key, the webhook secret, the state directory) is readable or writable, and no VMM can signal,
  trace or open the descriptors (/proc/PID/fd) of another, as it could if they shared a uid;
- every file it needs is opened by the host and handed over as a descriptor (`/proc/self/fd/N`
  or `fd=N`): the VM user needs no path into the state directory, which stays root's 0700;
- the template's RAM is a sealed memfd (no writes, no growth, seals sealed): QEMU 7.2 opens a
  `memory-backend-file` read-write even for a private mapping, so handing it the template file
  itself would hand it a writable template. A sealed memfd still maps privately copy-on-write.
- a network namespace of its own with nothing in it: the tap is a descriptor the host opened in
  the VM's slot, so the VMM needs no network, and its own sockets reach neither the host's
  loopback nor the slot's uplink;
- a seccomp filter of our own under QEMU's, refusing what `-sandbox` lets through and an
  unprivileged process can still use to widen the kernel it reaches: new namespaces (unshare,
  setns, namespace-creating clones; a user namespace gives CAP_NET_ADMIN & co. over it);
- a file size limit (RLIMIT_FSIZE, hard): it writes its stderr and its disk overlay, and neither
  may grow past the guest's disk plus qcow2 metadata, however much it writes;
- a parent-death signal (SIGKILL) so that no guest outlives the service that supervises it.

All of it is done by `confine`, in the forked child just before it execs QEMU. The parent-death
signal fires when the *thread* that forked the VMM ends, and a uid change clears it; so VMMs are
forked by one long-lived thread (`Spawner`), the signal is armed after the uid change, and the
child then checks that its parent is still the service: if the service died between the fork and
the arming, no signal will ever come, and the child exits instead of starting an unsupervised VM.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import pwd
import queue
import resource
import shutil
import signal
import struct
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from runner import uidrange
from runner.uidrange import UidLease
from runner.vm.errors import VMError

VM_USER = "microvm-check-vm"
# One uid per running VMM (runner.uidrange, shared with the fleet's runners); no passwd entry
# needed. doctor checks that none is taken.
VM_UIDS = uidrange.VMS.uids
UID_LEASES = uidrange.VMS.leases
FILE_SIZE_SLACK = 64 << 20  # a qcow2 overlay's metadata beyond the guest's data; plenty for any disk size
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI, _IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
_COPY_CHUNK = 1 << 20
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 24, 38
# No transparent huge pages for the VMM (kept across exec): QEMU asks for them on its 128 MiB TCG buffer and
# thread stacks, so every 2 MiB it touches becomes resident whole. Idle PSS per VM -5 MiB (8 VMs, alternated
# in one run), a job mixing python, git and a venv no slower; the price is a destroy 4-5 ms longer, waiting
# for QEMU's exit (docs/platform.md).
_PR_SET_THP_DISABLE = 41
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_CLONE_NAMESPACES = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
_SCMP_ACT_ALLOW, _SCMP_CMP_MASKED_EQ = 0x7FFF0000, 7

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


def lease_uid() -> UidLease:
    """The lowest free uid of `VM_UIDS`; free across every engine and process on this host. The lease
    (an flock, runner.uidrange) is released by `close` once the VMM is reaped, or by the kernel when
    the service dies (its VMMs die with it)."""
    return uidrange.VMS.lease(lambda message: VMError(f"{message}: this host runs as many VMs as it can"))


def taken_vm_uids() -> list[str]:
    """Accounts whose uid lies in `VM_UIDS`: a VMM running as one would share it with them."""
    return uidrange.VMS.taken()


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


def confine(user: VMUser | None, max_file_bytes: int | None = None) -> Callable[[], None]:
    """The `preexec_fn` of a VMM: runs in the forked child, as root, after `setsid` and before exec.

    In order: no transparent huge pages (a memory saving, not a wall); an empty network namespace;
    the file size limit (soft and hard: the VMM cannot raise it); for a restored VM, no bounding
    capabilities, no groups, the VM user's gid and uid, no_new_privs and the namespace filter; then
    the parent-death signal (after the uid change, which would clear it) and the check that the
    parent has not died already. Everything it calls is bound here, in the parent: the child of a
    threaded process must not import or take locks.
    """
    parent, unshare, prctl, fail = os.getpid(), _libc.unshare, _libc.prctl, _raise_errno
    last_cap = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    setgroups, setresgid, setresuid, getppid = os.setgroups, os.setresgid, os.setresuid, os.getppid
    setrlimit, fsize = resource.setrlimit, resource.RLIMIT_FSIZE
    program = ctypes.byref(_SockFprog.of(_namespace_filter())) if user is not None else None

    def setup() -> None:
        if prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
            fail("PR_SET_THP_DISABLE")
        if unshare(_CLONE_NEWNET) != 0:
            fail("unshare(CLONE_NEWNET)")
        if max_file_bytes is not None:
            setrlimit(fsize, (max_file_bytes, max_file_bytes))
        if user is not None:
            for cap in range(last_cap + 1):
                if prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    fail("PR_CAPBSET_DROP")
            setgroups([])
            setresgid(user.gid, user.gid, user.gid)
            setresuid(user.uid, user.uid, user.uid)
            if prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                fail("PR_SET_NO_NEW_PRIVS")
            if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, program, 0, 0) != 0:
                fail("PR_SET_SECCOMP")
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            fail("PR_SET_PDEATHSIG")
        if getppid() != parent:  # the service died before the signal was armed
            os._exit(1)

    return setup


class _SockFprog(ctypes.Structure):
    """struct sock_fprog: a classic BPF program as PR_SET_SECCOMP takes it (8 bytes an instruction)."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    @classmethod
    def of(cls, bpf: bytes) -> _SockFprog:
        return cls(len(bpf) // 8, bpf)


class _ArgCmp(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


@functools.cache
def _namespace_filter() -> bytes:
    """The BPF of the jail's own seccomp filter, built once with libseccomp (QEMU's dependency).

    unshare and setns fail with EPERM, so does clone with any CLONE_NEW* flag, and clone3 (whose
    flags a filter cannot see) with ENOSYS, on which glibc falls back to clone. Other
    architectures' system calls (int 0x80) kill the process: libseccomp's default for them."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        raise VMError("libseccomp is not installed: apt-get install libseccomp2") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]

    def deny(ctx: int, name: str, code: int, *conditions: _ArgCmp) -> None:
        array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
        rc = lib.seccomp_rule_add_array(ctx, 0x00050000 | code, lib.seccomp_syscall_resolve_name(name.encode()),
                                        len(conditions), array)
        if rc < 0:
            raise VMError(f"libseccomp refused the rule for {name}: {os.strerror(-rc)}")

    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise VMError("libseccomp could not start a filter")
    out = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
    try:
        deny(ctx, "unshare", errno.EPERM)
        deny(ctx, "setns", errno.EPERM)
        deny(ctx, "clone3", errno.ENOSYS)
        for flag in _CLONE_NAMESPACES:
            deny(ctx, "clone", errno.EPERM, _ArgCmp(0, _SCMP_CMP_MASKED_EQ, flag, flag))
        if lib.seccomp_export_bpf(ctx, out) < 0:
            raise VMError("libseccomp could not export the filter")
        return os.pread(out, os.fstat(out).st_size, 0)
    finally:
        os.close(out)
        lib.seccomp_release(ctx)


def _raise_errno(what: str) -> None:
    code = ctypes.get_errno()
    raise OSError(code, f"{what}: {os.strerror(code)}")


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
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="vmm-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._jobs.get()()

    def run(self, fn: Callable[[], T]) -> T:
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[T] = Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed back to the caller
                future.set_exception(exc)

        self._jobs.put(job)
        return future.result()


_spawner: Spawner | None = None
_spawner_lock = threading.Lock()


def spawner() -> Spawner:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = Spawner()
        return _spawner
