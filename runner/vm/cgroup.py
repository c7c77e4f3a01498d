"""One cgroup per VM with CPU, memory and pids limits: a guest cannot take the host's CPUs, memory or
process table, whatever it makes its VMM do.

cgroup v2 when /sys/fs/cgroup is the unified hierarchy, otherwise v1's cpu, memory and pids
hierarchies (wherever they are mounted). A VM's cgroups are `microvm-check/<scope>/<vm id>`; the
scope is derived from the engine's VM directory, so an engine's start-up sweep only ever touches
what an earlier engine of the same state directory left.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner.vm.errors import VMError

ROOT = Path("/sys/fs/cgroup")
PARENT = "microvm-check"
V1_CONTROLLERS = ("cpu", "memory", "pids")
CPU_PERIOD_US = 100_000
RMDIR_TIMEOUT_S = 5.0
_PARENT_RACE_TRIES = 3  # makes of a scope directory, each after the shared parent was removed under it
# cgroup v2 cpu.weight (v1 cpu.shares = weight x 10.24, at least 2) of a VM no job owns yet (spawned ahead,
# in the spare pool) and of a job's VM: against its engine's other VMs, a spare takes only the CPU left over.
SPARE_CPU_WEIGHT = 1
JOB_CPU_WEIGHT = 100


@dataclass(frozen=True)
class VMCgroupLimits:
    cpus: float  # CPU time per wall-clock time (1.0 = one core)
    memory_bytes: int
    pids: int


def limits_for(vcpus: int, memory_mib: int) -> VMCgroupLimits:
    """The guest's vCPUs plus one core for QEMU's main loop and I/O; its RAM plus room for QEMU's own
    memory and the TCG translation cache; pids for QEMU's threads (vCPUs, RCU, I/O workers)."""
    return VMCgroupLimits(cpus=vcpus + 1.0, memory_bytes=(memory_mib + 512) << 20, pids=128)


def scope_for(vms_dir: Path) -> str:
    return hashlib.sha256(str(vms_dir.resolve()).encode()).hexdigest()[:12]


def version() -> str | None:
    """'v2', 'v1', or None when neither has the cpu, memory and pids controllers."""
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists():
        have = set(controllers.read_text().split())
        return "v2" if set(V1_CONTROLLERS) <= have else None
    return "v1" if all(v1_mount(c) is not None for c in V1_CONTROLLERS) else None


def v1_mount(controller: str) -> Path | None:
    """Where `controller`'s v1 hierarchy is mounted, if it is (runner.fleet.cgroup asks for pids)."""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "cgroup" and controller in fields[3].split(","):
                return Path(fields[1])
    return None


def _mounted_v1(controller: str) -> Path:
    """Where `controller`'s v1 hierarchy is mounted; `version()` found it, but it can be unmounted since."""
    mount = v1_mount(controller)
    if mount is None:
        raise VMError(f"the cgroup v1 {controller} controller is no longer mounted: mount it again, or use cgroup v2")
    return mount


def _bases(scope: str) -> list[Path]:
    """The directories under which this scope's VM cgroups live (one per v1 hierarchy)."""
    found = version()
    if found == "v2":
        return [ROOT / PARENT / scope]
    if found == "v1":
        return [_mounted_v1(c) / PARENT / scope for c in V1_CONTROLLERS]
    raise VMError("no usable cgroup hierarchy with the cpu, memory and pids controllers: "
                  "mount cgroup v2 at /sys/fs/cgroup (or v1's cpu, memory and pids hierarchies)")


def _enable_v2_controllers(base: Path) -> None:
    """In v2 a controller works in a child only if every ancestor delegates it (subtree_control)."""
    wanted = " ".join(f"+{c}" for c in V1_CONTROLLERS)
    retry_past_parent_removal(lambda: _delegate(base, wanted))


def _delegate(base: Path, wanted: str) -> None:
    for directory in (ROOT, ROOT / PARENT, base):
        directory.mkdir(exist_ok=True)
        (directory / "cgroup.subtree_control").write_text(wanted)


def make_dirs(path: Path) -> None:
    """`mkdir -p` of a scope's directory under a shared parent that a peer's `remove_shared_parent` may
    rmdir (when empty) between this mkdir's steps: then it is made again."""
    retry_past_parent_removal(lambda: path.mkdir(parents=True, exist_ok=True))


def retry_past_parent_removal(make: Callable[[], None]) -> None:
    for _ in range(_PARENT_RACE_TRIES - 1):
        try:
            make()
            return
        except FileNotFoundError:  # the shared parent went between two steps: an rmdir of an empty one
            continue
    make()


def remove_shared_parent(parent: Path) -> None:
    """The shared parent (`microvm-check`, `microvm-check-runners`) goes with its last scope, so a host
    whose services all stopped keeps no directory of ours; rmdir only, so a peer's scope keeps it."""
    try:
        parent.rmdir()
    except OSError:  # another engine's or fleet's scope is in it, or it is gone already
        pass


@dataclass
class VMCgroup:
    """The cgroup directories of one VM (one in v2, one per controller in v1)."""

    paths: list[Path]
    version: str

    @classmethod
    def create(cls, scope: str, name: str, limits: VMCgroupLimits) -> VMCgroup:
        bases = _bases(scope)
        found = "v2" if len(bases) == 1 else "v1"
        group = cls([base / name for base in bases], found)
        try:
            try:
                group._make(bases)
            except FileNotFoundError:  # another engine's start-up removed the empty scope meanwhile: once more
                group._make(bases, again=True)
            group._limit(limits)
        except OSError as exc:
            raise VMError(f"cannot create the VM's cgroup under {bases[0]}: {exc}") from None
        return group

    def _make(self, bases: list[Path], again: bool = False) -> None:
        """The scope's directories (made if missing) and this VM's in each; `again`: some may be ours already."""
        if self.version == "v2":
            _enable_v2_controllers(bases[0])
        else:
            for base in bases:
                make_dirs(base)
        for path in self.paths:
            path.mkdir(exist_ok=again)

    def _limit(self, limits: VMCgroupLimits) -> None:
        quota = int(limits.cpus * CPU_PERIOD_US)
        if self.version == "v2":
            path = self.paths[0]
            (path / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
            (path / "memory.max").write_text(str(limits.memory_bytes))
            (path / "pids.max").write_text(str(limits.pids))
            return
        cpu, memory, pids = self.paths
        (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))
        (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        (pids / "pids.max").write_text(str(limits.pids))

    def add(self, pid: int) -> None:
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(pid))

    def weigh(self, weight: int) -> None:
        """The VM's share of the CPU against its siblings (the engine's other VMs) when they compete."""
        if self.version == "v2":
            (self.paths[0] / "cpu.weight").write_text(str(weight))
        else:
            (self.paths[0] / "cpu.shares").write_text(str(max(2, round(weight * 10.24))))

    def remove(self) -> None:
        """Kill whatever is still inside, then remove the directories (idempotent)."""
        for path in self.paths:
            _remove(path)


def _pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_and_rmdir(path: Path, timeout: float) -> None:
    """SIGKILL every process in the cgroup at `path` until the directory can be removed (gone already
    is fine). Raises the OSError of a failed rmdir: EBUSY past `timeout` seconds (a member that will
    not exit), or any other. Shared with runner.fleet.cgroup, whose callers word their own error."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in _pids(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:  # EBUSY: a killed process has not exited yet
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _remove(path: Path) -> None:
    try:
        kill_and_rmdir(path, RMDIR_TIMEOUT_S)
    except OSError as exc:
        raise VMError(f"cannot remove cgroup {path}: {exc}") from None


def groups(scope: str) -> list[Path]:
    """The VM cgroup directories that exist in this scope (one per VM and hierarchy)."""
    if version() is None:
        return []
    return [entry for base in _bases(scope) if base.is_dir() for entry in base.iterdir() if entry.is_dir()]


def scope_paths(scope: str) -> list[Path]:
    """The scope's own directories (one per hierarchy), whether they exist or not."""
    return _bases(scope) if version() is not None else []


def remove_scope(scope: str) -> None:
    """Remove this scope's own directories once its VMs' are gone (an engine's close): rmdir only, so a
    scope that still holds a VM's cgroup stays, and nothing is killed."""
    for base in scope_paths(scope):
        try:
            base.rmdir()
        except OSError:  # gone already, or not empty: a VM's cgroup the engine could not remove
            continue
        remove_shared_parent(base.parent)


def remove_empty_scopes(min_age_s: float = 60.0) -> list[str]:
    """Remove the empty scope directories of engines that ended without closing (a crash, a kill): rmdir,
    which only an empty cgroup allows. Younger than `min_age_s` is left alone: an engine that has just made
    its scope is about to create a VM's cgroup in it. Says what it removed."""
    found = version()
    if found is None:
        return []
    parents = [ROOT / PARENT] if found == "v2" else [_mounted_v1(c) / PARENT for c in V1_CONTROLLERS]
    removed = []
    now = time.time()
    for parent in parents:
        try:
            entries = [e for e in parent.iterdir() if e.is_dir()]
        except OSError:
            continue
        for entry in entries:
            try:
                if now - entry.stat().st_mtime < min_age_s or any(e.is_dir() for e in entry.iterdir()):
                    continue
                entry.rmdir()
            except OSError:  # not empty after all (processes, a child made meanwhile), or gone
                continue
            removed.append(f"empty cgroup {entry}")
        remove_shared_parent(parent)
    return removed


def sweep(scope: str) -> list[str]:
    """Kill and remove the VM cgroups an earlier engine of this scope left; say what was found."""
    found = []
    for entry in groups(scope):
        _remove(entry)
        found.append(f"cgroup {entry}")
    return found
