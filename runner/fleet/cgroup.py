"""One cgroup per runner, so that nothing a job starts outlives its runner.

Killing the runner's session is not enough: a job may `setsid` (or daemonize) into a session of its
own, and since runners share one user it would then live on beside the next job. A process cannot
leave its cgroup without write access to another cgroup's `cgroup.procs`, all root's, so the
cgroup holds everything the job started. At the runner's end `pids.max` is set to 0 (no process in
the group can fork any more, so killing cannot race a fork bomb), every member is killed, and the
group is removed.

The pids controller is what containment needs: cgroup v2's unified hierarchy, or v1's pids hierarchy
(as runner/vm/cgroup.py does for VMs). The runner's limits (`RunnerCgroupLimits`: memory, CPU weight) use the
memory and cpu controllers: in v2 on the same group, in v1 on groups of the same name in their
hierarchies, which every process of the runner joins too. Groups are `microvm-check-runners/<scope>/<runner name>`, the scope
derived from the runners directory, so the start-up sweep only touches what an earlier service of
the same directory left.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from runner.vm import cgroup as vm_cgroup

ROOT = Path("/sys/fs/cgroup")
PARENT = "microvm-check-runners"
EMPTY_TIMEOUT_SECONDS = 10.0


class CgroupError(OSError):
    """The runner's cgroup could not be made or emptied; the message says which and why."""


def scope_for(runners_dir: Path) -> str:
    return hashlib.sha256(str(runners_dir.resolve()).encode()).hexdigest()[:12]


def _pids_root() -> Path:
    """The hierarchy with the pids controller: v2's unified one, or v1's pids mount."""
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists():
        if "pids" not in controllers.read_text().split():
            raise CgroupError("cgroup v2 has no pids controller: runners cannot be contained")
        return ROOT
    mount = vm_cgroup.v1_mount("pids")
    if mount is not None:
        return mount
    raise CgroupError("no cgroup hierarchy with the pids controller (mount cgroup v2 at /sys/fs/cgroup, or v1's "
                      "pids hierarchy): runners cannot be contained")


def _delegate(base: Path, wanted: str) -> None:
    for directory in (ROOT, ROOT / PARENT, base):
        directory.mkdir(exist_ok=True)
        (directory / "cgroup.subtree_control").write_text(wanted)


def _base(scope: str) -> Path:
    root = _pids_root()
    base = root / PARENT / scope
    if root == ROOT and (ROOT / "cgroup.controllers").exists():  # v2: each ancestor must delegate them
        wanted = " ".join(f"+{c}" for c in ("pids", "memory", "cpu") if c in (ROOT / "cgroup.controllers").read_text().split())
        vm_cgroup.retry_past_parent_removal(lambda: _delegate(base, wanted))
    else:
        vm_cgroup.make_dirs(base)
    return base


@dataclass(frozen=True)
class RunnerCgroupLimits:
    """What one runner may use of the host: memory (bytes, its tmpfs files included) and a CPU weight
    against the other runners (cgroup v2 cpu.weight 1-10000, default 100; v1 cpu.shares = weight x 10.24)."""

    memory_bytes: int
    cpu_weight: int


@dataclass(frozen=True)
class RunnerCgroup:
    path: Path  # the pids group: what is killed at the runner's end
    limited: tuple[Path, ...] = ()  # cgroup v1: the runner's groups in the memory and cpu hierarchies

    @classmethod
    def create(cls, scope: str, name: str, limits: RunnerCgroupLimits | None = None) -> RunnerCgroup:
        """The runner's groups, limited; on any failure none of them is left (a fleet retrying a start
        that cannot succeed would otherwise leave a group per try)."""
        made: list[Path] = []
        try:
            path = _base(scope) / name
            path.mkdir()
            made.append(path)
            limited = _limited(scope, name, made) if limits is not None else ()
            group = cls(path, limited)
            if limits is not None:
                group._limit(limits)
        except OSError as exc:
            for directory in reversed(made):
                directory.rmdir()
            raise CgroupError(f"cannot create the runner's cgroup for {name}: {exc}") from None
        return group

    def _limit(self, limits: RunnerCgroupLimits) -> None:
        if not self.limited:  # v2: one group holds every controller
            (self.path / "memory.max").write_text(str(limits.memory_bytes))
            (self.path / "memory.swap.max").write_text("0")
            (self.path / "cpu.weight").write_text(str(limits.cpu_weight))
            return
        memory, cpu = self.limited
        (memory / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
        (cpu / "cpu.shares").write_text(str(max(2, round(limits.cpu_weight * 10.24))))

    def add(self, pid: int) -> None:
        for path in (self.path, *self.limited):
            (path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def destroy(self) -> None:
        """Stop forks, kill every process in the group, remove it and its v1 limit groups (idempotent)."""
        _empty(self.path)
        for path in self.limited:
            try:
                vm_cgroup.kill_and_rmdir(path, EMPTY_TIMEOUT_SECONDS)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise CgroupError(f"cannot remove the runner cgroup {path}: {exc}") from None


def _limited(scope: str, name: str, made: list[Path]) -> tuple[Path, ...]:
    """cgroup v1: the runner's own groups in the memory and cpu hierarchies (made here, each noted in
    `made` as soon as it exists); v2: none, the pids group itself carries the limits (its ancestors
    delegate memory and cpu, see `_base`)."""
    if (ROOT / "cgroup.controllers").exists():
        return ()
    start = len(made)
    for controller in ("memory", "cpu"):
        mount = vm_cgroup.v1_mount(controller)
        if mount is None:
            raise CgroupError(f"no cgroup v1 {controller} hierarchy: runners cannot be limited (mount it, or "
                              "use cgroup v2)")
        path = mount / PARENT / scope / name
        vm_cgroup.make_dirs(path.parent)
        path.mkdir()
        made.append(path)
    return tuple(made[start:])


def _empty(path: Path) -> None:
    try:
        (path / "pids.max").write_text("0")
    except FileNotFoundError:
        return
    try:
        vm_cgroup.kill_and_rmdir(path, EMPTY_TIMEOUT_SECONDS)
    except OSError as exc:
        raise CgroupError(f"cannot remove the runner cgroup {path}: {exc}") from None


def sweep(scope: str) -> list[Path]:
    """Kill and remove the runner cgroups an earlier service of this scope left; returns them."""
    base = _base(scope)
    found = [entry for entry in base.iterdir() if entry.is_dir()]
    for entry in found:
        _empty(entry)
    for limits in _v1_limit_scopes(scope):
        for entry in (e for e in limits.iterdir() if e.is_dir()):
            vm_cgroup.kill_and_rmdir(entry, EMPTY_TIMEOUT_SECONDS)
    return found


def _v1_limit_scopes(scope: str) -> list[Path]:
    """cgroup v1: this scope's directories in the memory and cpu hierarchies that exist."""
    if (ROOT / "cgroup.controllers").exists():
        return []
    mounts = [vm_cgroup.v1_mount(controller) for controller in ("memory", "cpu")]
    return [mount / PARENT / scope for mount in mounts if mount is not None and (mount / PARENT / scope).is_dir()]


def scope_exists(scope: str) -> bool:
    """Whether any of the scope's directories is still there (a runner's group that failed to go keeps it)."""
    try:
        return any(path.is_dir() for path in (_pids_root() / PARENT / scope, *_v1_limit_scopes(scope)))
    except CgroupError:
        return False


def remove_scope(scope: str) -> None:
    """The service stops: its (by now empty) scope goes too, so stopped services leave no directories."""
    for path in (_pids_root() / PARENT / scope, *_v1_limit_scopes(scope)):
        try:
            path.rmdir()
        except OSError:
            continue  # not empty (a runner's group failed to go: logged then), or already gone
        vm_cgroup.remove_shared_parent(path.parent)
