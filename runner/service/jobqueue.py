"""The bounded job queue: backpressure instead of unbounded memory and disk.

A slot is reserved when a job is submitted, before its checkout is uploaded, so a burst of submits
cannot each spool a checkout and only then find the queue full. Workers take queued jobs in order;
the number of workers is the limit on concurrent VMs.
"""

from __future__ import annotations

import threading
from collections import deque

from runner.errors import JobError


class QueueFull(JobError):
    """No room: the client should retry after `retry_after` seconds."""

    def __init__(self, capacity: int, retry_after: int) -> None:
        super().__init__(f"the job queue is full ({capacity} jobs waiting); retry in {retry_after} s")
        self.retry_after = retry_after


class QueueClosed(JobError):
    """The service is shutting down and takes no more jobs."""


class JobQueue:
    def __init__(self, capacity: int, retry_after: int = 5) -> None:
        self.capacity = capacity
        self.retry_after = retry_after
        self._cond = threading.Condition()
        self._reserved: set[str] = set()
        self._queued: deque[str] = deque()
        self._closed = False

    def reserve(self, job_id: str) -> None:
        with self._cond:
            if self._closed:
                raise QueueClosed("the service is shutting down; submit the job again later")
            if len(self._reserved) >= self.capacity:
                raise QueueFull(self.capacity, self.retry_after)
            self._reserved.add(job_id)

    def put(self, job_id: str) -> None:
        """Queue a reserved job; KeyError if it holds no reservation (cancelled or never submitted)."""
        with self._cond:
            if self._closed:
                raise QueueClosed("the service is shutting down; submit the job again later")
            if job_id not in self._reserved or job_id in self._queued:
                raise KeyError(job_id)
            self._queued.append(job_id)
            self._cond.notify()

    def get(self) -> str | None:
        """The next queued job, blocking; None once the queue is closed. Its slot is freed on taking."""
        with self._cond:
            while not self._queued and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            job_id = self._queued.popleft()
            self._reserved.discard(job_id)
            return job_id

    def discard(self, job_id: str) -> bool:
        """Drop a job that has not been taken by a worker yet; True if it was still waiting."""
        with self._cond:
            if job_id not in self._reserved:
                return False
            self._reserved.discard(job_id)
            if job_id in self._queued:
                self._queued.remove(job_id)
            return True

    def close(self) -> list[str]:
        """Stop: wake every worker and hand back the jobs that never started."""
        with self._cond:
            self._closed = True
            left = list(self._reserved)
            self._reserved.clear()
            self._queued.clear()
            self._cond.notify_all()
            return left

    def counts(self) -> tuple[int, int]:
        """(queued, awaiting checkout)."""
        with self._cond:
            return len(self._queued), len(self._reserved) - len(self._queued)
