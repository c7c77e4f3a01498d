"""One cgroup per runner, so that nothing a job starts outlives its runner.

Killing the runner's session is not enough: a job may `setsid` (or daemonize) into a session of its
own, and since runners share one user it would then live on beside the next job. A process cannot
leave its cgroup without write access to another cgroup's `cgroup.procs`, all root's, so the
cgroup holds everything the job started. At the runner's end `pids.max` is set to 0 (no process in
the group can fork any more, so killing cannot race a fork bomb), every member is killed, and the
group is removed.

The pids controller is all it needs: cgroup v2's unified hierarchy, or v1's pids hierarchy (as
runner/vm/cgroup.py does for VMs). Groups are `microvm-check-runners/<scope>/<runner name>`, the scope
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


def _base(scope: str) -> Path:
    root = _pids_root()
    base = root / PARENT / scope
    if root == ROOT and (ROOT / "cgroup.controllers").exists():  # v2: each ancestor must delegate pids
        for directory in (ROOT, ROOT / PARENT, base):
            directory.mkdir(exist_ok=True)
            (directory / "cgroup.subtree_control").write_text("+pids")
    else:
        base.mkdir(parents=True, exist_ok=True)
    return base


@dataclass(frozen=True)
class RunnerCgroup:
    path: Path

    @classmethod
    def create(cls, scope: str, name: str) -> RunnerCgroup:
        try:
            path = _base(scope) / name
            path.mkdir()
        except OSError as exc:
            raise CgroupError(f"cannot create the runner's cgroup for {name}: {exc}") from None
        return cls(path)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def destroy(self) -> None:
        """Stop forks, kill every process in the group, remove it (idempotent)."""
        _empty(self.path)


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
    return found


def remove_scope(scope: str) -> None:
    """The service stops: its (by now empty) scope goes too, so stopped services leave no directories."""
    try:
        (_pids_root() / PARENT / scope).rmdir()
    except OSError:
        pass  # not empty (a runner's group failed to go: logged then), or already gone
