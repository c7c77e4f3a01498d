"""Which accelerator QEMU can really use here: KVM when a guest truly runs under it, else TCG.

Opening /dev/kvm proves nothing: on nested clouds it can be a software backend (PVM) on which
KVM_CREATE_VM works but a stock Linux guest crashes at its first system call. So we rule out
what we can recognise, and otherwise only believe a bounded test boot of the real guest kernel
that reaches user space.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SELFTEST_MARKER = "MICROVM-CHECK-SELFTEST-OK"
SELFTEST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Accel:
    name: str  # "kvm" | "tcg"
    reason: str  # why, in words a person can check


def static_checks() -> Accel | None:
    """A verdict from the host's own facts, or None when only a test boot can tell."""
    forced = os.environ.get("MICROVM_CHECK_ACCEL")
    if forced in ("kvm", "tcg"):
        return Accel(forced, f"forced by MICROVM_CHECK_ACCEL={forced}")
    if not os.path.exists("/dev/kvm"):
        return Accel("tcg", "/dev/kvm does not exist (no KVM module or not exposed to this machine)")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return Accel("tcg", "/dev/kvm is not readable and writable by this user")
    if Path("/sys/module/kvm_pvm").exists():
        return Accel("tcg", "/dev/kvm is the PVM software backend (kvm_pvm): stock Linux guests fail under it")
    flags = _cpu_flags()
    if not flags & {"vmx", "svm"}:
        return Accel("tcg", "the CPU shows no vmx/svm flag: no hardware virtualisation for KVM")
    return None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def selftest(qemu: str, kernel: Path, initrd: Path, accel: str, timeout: float = SELFTEST_TIMEOUT_S) -> tuple[bool, str]:
    """Boot the guest kernel and initramfs under `accel` until its init reaches user space.

    The initramfs init prints the marker and powers off when given `microvm.selftest`; printing
    it needs working system calls, which is exactly what a broken KVM lacks.
    """
    cpu = "host" if accel == "kvm" else "qemu64"
    with tempfile.TemporaryDirectory(prefix="mvc-selftest-") as tmp:
        console = Path(tmp) / "console.log"
        argv = [
            qemu, "-accel", accel, "-M", "pc", "-cpu", cpu, "-m", "256M", "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none", "-no-reboot",
            "-kernel", str(kernel), "-initrd", str(initrd),
            "-append", "console=ttyS0 quiet panic=-1 microvm.selftest",
            "-serial", f"file:{console}",
        ]
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=timeout)
            detail = proc.stderr.decode(errors="replace").strip()[-300:]
        except subprocess.TimeoutExpired:
            detail = f"no answer within {timeout:.0f} s"
        text = console.read_text(errors="replace") if console.exists() else ""
        if SELFTEST_MARKER in text:
            return True, f"a test boot under {accel} reached guest user space"
        return False, f"a test boot under {accel} failed: {detail or 'the guest never reached user space'}"


def detect(qemu: str, kernel: Path, initrd: Path) -> Accel:
    verdict = static_checks()
    if verdict is not None:
        return verdict
    ok, why = selftest(qemu, kernel, initrd, "kvm")
    return Accel("kvm", why) if ok else Accel("tcg", why)
