"""What the running VMs of one state directory cost in memory, per accelerator.

PSS (proportional set size, /proc/PID/smaps_rollup) is the honest per-VM figure here: every clone
maps the template's RAM privately, so the pages no clone has written are shared and split between
them, and what a VM wrote (its guest's dirty pages, TCG's translation buffer, QEMU's heap) is its own.
KVM and TCG differ a lot (TCG keeps translated code per VM), so they are reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.vm.sweep import processes_under


@dataclass(frozen=True)
class AccelMemory:
    accel: str
    vms: int
    pss_mib: float  # the mean over those VMs

    def describe(self) -> str:
        return f"{self.accel} {self.pss_mib:.1f} MiB per VM ({self.vms} running)"


def host_memory_mib() -> int | None:
    """The host's memory (MemTotal) in MiB, or None when /proc/meminfo cannot tell."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024
    except (OSError, StopIteration, ValueError):
        return None


def pss_mib(pid: int) -> float | None:
    """The process's PSS in MiB, or None if it is gone (or not readable)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return None


def accel_of(pid: int) -> str | None:
    """The accelerator named by a QEMU's `-accel NAME[,options]`, or None."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for flag, value in zip(argv, argv[1:]):
        if flag == b"-accel":
            return value.split(b",", 1)[0].decode(errors="replace")
    return None


def by_accel(vms_dir: Path) -> dict[str, AccelMemory]:
    """PSS per VM of the VMMs running under `vms_dir` (as the sweep finds them), keyed by accelerator."""
    seen: dict[str, list[float]] = {}
    for pid in processes_under(vms_dir):
        accel, pss = accel_of(pid), pss_mib(pid)
        if accel is not None and pss is not None:
            seen.setdefault(accel, []).append(pss)
    return {name: AccelMemory(name, len(values), sum(values) / len(values)) for name, values in sorted(seen.items())}


def describe(vms_dir: Path) -> str:
    """One phrase for doctor's accelerator line: KVM and TCG each, measured or 'none running'."""
    found = by_accel(vms_dir)
    parts = [found[name].describe() if name in found else f"{name} none running" for name in ("kvm", "tcg")]
    return "PSS: " + ", ".join(parts)
