"""Submitting into a full queue: wait as the service asks, say so in the job log, give up in time.

The service refuses a submit with 429 when `max_queued_jobs` jobs already wait to start; it sends
`Retry-After` and how many jobs wait (runner.jobapi.contract.QueueFullAnswer). A workflow should not
fail for that: the action waits and submits again. Each wait is bounded (a service's Retry-After of 0
must not become a busy loop, one of an hour must not hang the step) and jittered, so runs refused
together do not all come back in the same instant and meet the same full queue again. The waiting is
limited by the step's `timeout-minutes` input: a job that cannot even start in that time would not
finish in it either, so the step fails with an error that says why instead of running into GitHub's
own step timeout.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from runner.errors import UserError
from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import JobSpec, JobSummary

MIN_WAIT = 1.0  # seconds; also when the service says 0
MAX_WAIT = 30.0  # seconds; the queue is looked at again at least this often
DEFAULT_WAIT = 5.0  # a 429 without a usable Retry-After
JITTER = 0.2  # each wait is Retry-After times a random factor in [1 - JITTER, 1 + JITTER]


class QueueTimeout(UserError):
    """The queue stayed full for longer than the step's timeout-minutes."""


@dataclass
class QueueWait:
    """Submits a job, waiting out 429s for at most `timeout_minutes` (the action's input) in all.

    `say` writes one line to the job log; `clock`, `sleep` and `uniform` are injectable for tests.
    """

    timeout_minutes: float
    say: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    uniform: Callable[[float, float], float] = random.uniform

    def submit(self, client: JobClient, spec: JobSpec) -> JobSummary:
        start = self.clock()
        while True:
            try:
                return client.submit(spec)
            except JobAPIError as exc:
                if exc.status != 429:
                    raise
                left = start + self.timeout_minutes * 60 - self.clock()
                if left <= 0:
                    raise self._timeout(self.clock() - start, exc) from exc
                delay = min(self.delay(exc.retry_after), left)
                self.say(f"the service's queue is full; {_behind(exc.queued)}retrying in {delay:.0f} s")
                self.sleep(delay)

    def delay(self, retry_after: float | None) -> float:
        """The service's Retry-After, bounded to [MIN_WAIT, MAX_WAIT] before and after the jitter."""
        asked = DEFAULT_WAIT if retry_after is None else retry_after
        base = min(max(asked, MIN_WAIT), MAX_WAIT)
        return min(max(base * self.uniform(1 - JITTER, 1 + JITTER), MIN_WAIT), MAX_WAIT)

    def _timeout(self, waited: float, exc: JobAPIError) -> QueueTimeout:
        ahead = "" if exc.queued is None else f" ({_jobs(exc.queued)} waiting to start)"
        return QueueTimeout(
            f"the job service's queue stayed full for {waited:.0f} s{ahead}, as long as timeout-minutes "
            f"({self.timeout_minutes:g}) allows; the job was not submitted. Run the workflow again later, "
            f"or ask the service's operator to raise max_queued_jobs or max_concurrent_jobs")


def _jobs(count: int) -> str:
    return f"{count} job" if count == 1 else f"{count} jobs"


def _behind(queued: int | None) -> str:
    """ "queued behind N jobs, " when the service said how many wait (an older service does not)."""
    return "" if queued is None else f"queued behind {_jobs(queued)}, "
