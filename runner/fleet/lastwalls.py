"""The walls a runner's namespaces alone do not give, put up as root inside them just before the drop to
the runner's uid: runner/fleet/walls.py runs `python -I -m runner.fleet.lastwalls SETPRIV ...`, which
does both below and then execs `setpriv` (and so the runner) in its place.

- Its own POSIX message queue mounts. A new IPC namespace has queues of its own, but a mount of the
  mqueue filesystem shows the queues of the namespace that mounted it: the host's /dev/mqueue
  (systemd mounts it, mode 1777) stays the host's in the runner's copy of the mounts, and a queue
  made there outlives its maker. A job could leave one for the next runner of its uid, or read one
  another runner left. So every mqueue mount the runner's mount namespace has is covered by a fresh
  one of its own IPC namespace, gone with it.
- No kernel keyring. Keyrings are not namespaced by anything the walls make: a uid's user keyring
  lives as long as the kernel, and a job may set its keys' and that keyring's permissions so that
  nobody, root included, can clear, unlink or invalidate them while the next process of the uid can
  still read them. Clearing at release cannot win that; keeping keys out can. A seccomp filter,
  inherited by every process of the runner and never removable, makes add_key, request_key and
  keyctl fail with EPERM (as Docker's default profile does; the runner and its jobs' tools do not
  need them). A uid that owns keys anyway is never leased (runner.fleet.workdir).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import sys
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2

# The keyring calls, by the audit architecture a process calls through: a 64-bit x86 process may still
# make 32-bit calls (int 0x80), which the kernel reports as i386 with i386's numbers.
AUDIT_ARCH_X86_64, AUDIT_ARCH_I386 = 0xC000003E, 0x40000003
AUDIT_ARCH_AARCH64, AUDIT_ARCH_ARM = 0xC00000B7, 0x40000028
KEYRING_CALLS = {  # add_key, request_key, keyctl
    AUDIT_ARCH_X86_64: (248, 249, 250),
    AUDIT_ARCH_I386: (286, 287, 288),
    AUDIT_ARCH_AARCH64: (217, 218, 219),
    AUDIT_ARCH_ARM: (309, 310, 311),
}
X32_BIT = 0x40000000  # x32 calls come as x86_64 with this bit set, and share these numbers

# Classic BPF, as seccomp runs it on struct seccomp_data (nr at offset 0, arch at 4).
LD_W_ABS, JEQ_K, AND_K, RET_K = 0x20, 0x15, 0x54, 0x06
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000


def mqueue_mounts(mountinfo: str) -> list[str]:
    """Where the mount namespace of `mountinfo` (/proc/self/mountinfo's text) has an mqueue filesystem."""
    found = []
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        if rest.split(" ", 1)[0] == "mqueue":
            found.append(_unescape(fields.split(" ")[4]))
    return found


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return path.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def cover_mqueues(libc: ctypes.CDLL) -> None:
    """A fresh mqueue filesystem of this IPC namespace over each mqueue mount this mount namespace has."""
    for where in mqueue_mounts(MOUNTINFO.read_text()):
        flags = ctypes.c_ulong(MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if libc.mount(b"mvc-runner-mqueue", os.fsencode(where), b"mqueue", flags, None):
            code = ctypes.get_errno()
            raise OSError(code, f"cannot mount the runner's own message queues over {where}: {os.strerror(code)}")


def keyring_filter() -> bytes:
    """The seccomp program: the keyring calls fail with EPERM, everything else is allowed; a call through
    an architecture not in KEYRING_CALLS kills the process (none such runs on the hosts we know)."""
    program = [(LD_W_ABS, 0, 0, 4)]
    for arch, calls in KEYRING_CALLS.items():
        block = [(LD_W_ABS, 0, 0, 0)]
        if arch == AUDIT_ARCH_X86_64:
            block.append((AND_K, 0, 0, 0xFFFFFFFF ^ X32_BIT))
        block += [(JEQ_K, len(calls) - i, 0, call) for i, call in enumerate(calls)]
        block += [(RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, RET_ERRNO | errno.EPERM)]
        program += [(JEQ_K, 0, len(block), arch), *block]
    program.append((RET_K, 0, 0, RET_KILL_PROCESS))
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


class _Program(ctypes.Structure):
    """struct sock_fprog: the filter's length in instructions and where it is."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def refuse_keyrings(libc: ctypes.CDLL) -> None:
    """Install keyring_filter on this process; every process it execs or forks keeps it."""
    code = keyring_filter()
    buffer = ctypes.create_string_buffer(code, len(code))
    program = _Program(len(code) // 8, ctypes.addressof(buffer))
    zero = ctypes.c_ulong(0)
    if (libc.prctl(PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), zero, zero, zero)
            or libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER), ctypes.byref(program), zero, zero)):
        number = ctypes.get_errno()
        raise OSError(number, f"cannot refuse the kernel keyring to the runner (seccomp): {os.strerror(number)}")


def main(argv: list[str]) -> None:
    """Put up both walls, then exec `argv` (setpriv and the runner) in this process's place."""
    if not argv or not os.path.isabs(argv[0]):
        sys.exit("usage: python -I -m runner.fleet.lastwalls /ABSOLUTE/PROGRAM [ARG...]")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    cover_mqueues(libc)
    refuse_keyrings(libc)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
