"""What the fleet keeps and tells: its settings (the `runners:` section resolved), a runner it keeps, and
what became of one. Declared apart from the fleet's work (fleet.py) so the host's side of a runner
(processes.py) and the service's readers (its metrics, its status) share them without the fleet."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from runner.fleet import cgroup
from runner.fleet.cgroup import RunnerCgroup
from runner.fleet.status import STATUS_FILE
from runner.fleet.workdir import RunnerDir, RunnerUidLease
from runner.jobapi.contract import JobStarted


class RunnerState(str, Enum):
    IDLE = "idle"  # registered and started, no job reported yet
    BUSY = "busy"  # its job-started hook reported a job


@dataclass(frozen=True)
class FleetSettings:
    """The `runners:` section resolved: defaults that depend on the rest of the config filled in."""

    org: str
    labels: tuple[str, ...]
    runner_group: int
    min_idle: int
    max_runners: int
    idle_recycle_seconds: float
    shutdown_grace_seconds: float
    job_timeout_seconds: float
    deadline_grace_seconds: float
    network: str
    limits: cgroup.RunnerCgroupLimits
    runner_user: str
    install_dir: Path
    runners_dir: Path
    name_prefix: str
    status_path: Path
    socket: str  # the job API's Unix socket, which the runners' hooks and the action talk to
    state_dir: Path  # the service's own: where its claim on the runners' cgroup scope is kept (scope.py)

    @classmethod
    def from_config(cls, config: Any) -> FleetSettings:
        section = config.runners
        if section.org is None:
            raise ValueError("runners.org is not set: the fleet is off")
        prefix = section.name_prefix or f"mvc-{socket.gethostname().split('.')[0][:30]}"
        return cls(section.org, (*section.labels, *config.size_labels), section.runner_group, section.min_idle,
                   section.max_runners or config.max_concurrent_jobs, section.idle_recycle_seconds,
                   section.shutdown_grace_seconds, section.job_timeout_seconds, section.deadline_grace_seconds,
                   section.network, cgroup.RunnerCgroupLimits(section.memory_mib << 20, section.cpu_weight),
                   section.runner_user, section.install_dir, section.runners_dir,
                   prefix, config.state_dir / STATUS_FILE, config.socket, config.state_dir)


@dataclass
class FleetRunner:
    name: str
    dir: RunnerDir
    github_id: int
    process: subprocess.Popen[bytes]
    cgroup: RunnerCgroup
    since: float
    token: str = field(repr=False)
    identity: RunnerUidLease | None = None  # its own uid  # the runner's own credential (in its .env): binds its jobs to it
    state: RunnerState = RunnerState.IDLE
    job: JobStarted | None = None
    output: int = field(default=-1, repr=False)  # the file its stdout and stderr go to, kept open by the fleet

    def view(self) -> dict[str, Any]:
        return {"name": self.name, "id": self.github_id, "state": self.state.value, "since": self.since,
                "directory": str(self.dir.path), "pid": self.process.pid,
                "uid": self.identity.uid if self.identity else None,
                "job": {k: v for k, v in self.job.to_wire().items() if k != "guard"} if self.job else None}


@dataclass(frozen=True)
class RunnerEnd:
    """What became of a runner: for the status and the log."""

    name: str
    job: JobStarted | None
    exit_code: int | None  # None: retired by the fleet before it took a job
    died: bool  # it ended during its job, which was cancelled
    since: float  # FleetRunner.since at its end: when it started, or when its job was reported
    ended_at: float
