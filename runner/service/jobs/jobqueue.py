"""The bounded job queue: backpressure instead of unbounded memory and disk, shared fairly between tenants.

A slot is reserved when a job is submitted, before its checkout is uploaded, so a burst of submits
cannot each spool a checkout and only then find the queue full. Workers take queued jobs in order;
the number of workers is the limit on concurrent VMs.

Each job belongs to tenants (its repository, and the fleet runner that submitted it): a tenant
holds at most `max_queued[kind]` of the slots and runs at most `max_running[kind]` jobs at once,
so one runner or one repository can never take the whole queue or every VM. A worker takes the
first queued job whose tenants are under their running quota, preferring the repository with the
fewest jobs running (so a repository that queued 100 jobs first does not make another's one wait
for all of them); it reports `finished` when the job has ended.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping

from runner.errors import JobError

Tenants = Mapping[str, str]  # kind ("repository", "runner") -> name


class QueueFull(JobError):
    """No room: the client should retry after `retry_after` seconds."""

    def __init__(self, capacity: int, retry_after: int, why: str = "") -> None:
        super().__init__((why or f"the job queue is full ({capacity} jobs waiting)") + f"; retry in {retry_after} s")
        self.retry_after = retry_after


class QueueClosed(JobError):
    """The service is shutting down and takes no more jobs."""


class JobQueue:
    def __init__(self, capacity: int, retry_after: int = 5, max_queued: Mapping[str, int] | None = None,
                 max_running: Mapping[str, int] | None = None) -> None:
        self.capacity = capacity
        self.retry_after = retry_after
        self.max_queued = dict(max_queued or {})
        self.max_running = dict(max_running or {})
        self._cond = threading.Condition()
        self._reserved: dict[str, tuple[tuple[str, str], ...]] = {}  # job -> its tenants, until taken
        self._queued: deque[str] = deque()
        self._holding: Counter[tuple[str, str]] = Counter()  # slots reserved, by tenant
        self._running: Counter[tuple[str, str]] = Counter()
        self._taken: dict[str, tuple[tuple[str, str], ...]] = {}  # taken by a worker, until finished
        self._closed = False

    def reserve(self, job_id: str, tenants: Tenants | None = None) -> None:
        owners = tuple(sorted((kind, name) for kind, name in (tenants or {}).items() if name))
        with self._cond:
            if self._closed:
                raise QueueClosed("the service is shutting down; submit the job again later")
            if len(self._reserved) >= self.capacity:
                raise QueueFull(self.capacity, self.retry_after)
            for owner in owners:
                cap = self.max_queued.get(owner[0])
                if cap is not None and self._holding[owner] >= cap:
                    raise QueueFull(self.capacity, self.retry_after,
                                    f"{owner[0]} {owner[1]} already has {cap} jobs waiting to start (its share of "
                                    f"the queue, max_queued_per_{owner[0]})")
            self._reserved[job_id] = owners
            self._holding.update(owners)

    def put(self, job_id: str) -> None:
        """Queue a reserved job; KeyError if it holds no reservation (cancelled or never submitted)."""
        with self._cond:
            if self._closed:
                raise QueueClosed("the service is shutting down; submit the job again later")
            if job_id not in self._reserved or job_id in self._queued:
                raise KeyError(job_id)
            self._queued.append(job_id)
            self._cond.notify_all()

    def get(self) -> str | None:
        """The next queued job its tenants may run now, blocking; None once the queue is closed. Its slot
        is freed on taking; call `finished` when it has ended."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                job_id = self._eligible()
                if job_id is not None:
                    break
                self._cond.wait()
            self._queued.remove(job_id)
            owners = self._reserved.pop(job_id)
            self._holding.subtract(owners)
            self._running.update(owners)
            self._taken[job_id] = owners
            return job_id

    def _eligible(self) -> str | None:
        best: str | None = None
        best_load = 0
        for job_id in self._queued:
            owners = self._reserved[job_id]
            if any(self._running[o] >= self.max_running[o[0]] for o in owners if o[0] in self.max_running):
                continue
            load = sum(self._running[o] for o in owners if o[0] == "repository")
            if best is None or load < best_load:
                best, best_load = job_id, load
                if load == 0:
                    break
        return best

    def finished(self, job_id: str) -> None:
        """A taken job ended: its tenants may run another."""
        with self._cond:
            owners = self._taken.pop(job_id, ())
            self._running.subtract(owners)
            self._cond.notify_all()

    def discard(self, job_id: str) -> bool:
        """Drop a job that has not been taken by a worker yet; True if it was still waiting."""
        with self._cond:
            owners = self._reserved.pop(job_id, None)
            if owners is None:
                return False
            self._holding.subtract(owners)
            if job_id in self._queued:
                self._queued.remove(job_id)
            return True

    def close(self) -> list[str]:
        """Stop: wake every worker and hand back the jobs that never started."""
        with self._cond:
            self._closed = True
            left = list(self._reserved)
            self._reserved.clear()
            self._holding.clear()
            self._queued.clear()
            self._cond.notify_all()
            return left

    def counts(self) -> tuple[int, int]:
        """(queued, awaiting checkout)."""
        with self._cond:
            return len(self._queued), len(self._reserved) - len(self._queued)
