"""The jobs a service holds in memory: submitted and not yet ended, by id.

Every role of the service (the job API in `service.py`, the workers, the runner desk, the GitHub
reactions, retention) finds a job's `JobRun` here and nowhere else, under one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from runner.jobapi.contract import JobState
from runner.service.jobs.job import JobRun

log = logging.getLogger(__name__)


class ActiveRuns:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, JobRun] = {}

    def add(self, run: JobRun) -> None:
        with self._lock:
            self._runs[run.record.id] = run

    def pop(self, job_id: str) -> None:
        with self._lock:
            self._runs.pop(job_id, None)

    def get(self, job_id: str) -> JobRun | None:
        with self._lock:
            return self._runs.get(job_id)

    def all(self) -> list[JobRun]:
        with self._lock:
            return list(self._runs.values())

    def of_runner(self, runner: str) -> list[str]:
        """The ids of the jobs a runner's job submitted that have not ended."""
        return [run.record.id for run in self.all() if run.spec.runner_name == runner]


def finish(run: JobRun, state: JobState, reason: str) -> None:
    """`run.finish`, then the rest of what finishing means even if a save of its record failed, now or in
    an earlier `finish` (which then marked it final and stopped): the spooled checkout goes, log
    followers and cancel() waiters are released. Each step is idempotent."""
    try:
        run.finish(state, None, reason)
    finally:
        run.checkout_path.unlink(missing_ok=True)
        run.log.close()
        run.done.set()


def logged(step: Callable[..., object], what: str, *args: object) -> None:
    """Run one step of a background pass or of shutdown; its failure is logged with a traceback and the rest goes on."""
    try:
        step(*args)
    except Exception:
        log.exception("%s failed", what)
