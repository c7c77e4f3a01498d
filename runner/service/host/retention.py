"""Retention: what expires on its own while the service runs, and what a crash left behind.

The reaper thread expires unclaimed pre-warmed VMs, idle kept VMs and checkouts that never came, and
now and then applies the retention settings (`retention:`) to records and job directories; at start,
the directories no record knows and stale spools go.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time

from runner.jobapi.contract import JobState
from runner.service.jobs.job import ARTIFACTS, CHECKOUT
from runner.service.jobs.runs import logged
from runner.service.jobs.service import JobService

log = logging.getLogger(__name__)

_REAP_SECONDS = 5.0
_PRUNE_SECONDS = 3600.0


class Retention:
    def __init__(self, service: JobService) -> None:
        self.service = service
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._last_prune = 0.0

    def start(self) -> None:
        """Sweep what a dead predecessor left, prune, then start the reaper."""
        self.sweep_job_dirs()
        self.prune()
        self._reaper = threading.Thread(target=self._reap, name="job-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        if self._reaper:
            self._reaper.join()

    def _reap(self) -> None:
        """The reaper thread: nothing one pass meets may stop the next, or nothing expires until a restart."""
        while not self._stop.wait(_REAP_SECONDS) and not self.service.stopping:
            try:
                self.reap()
            except Exception:
                log.exception("the reaper's pass failed; it runs again in %g s", _REAP_SECONDS)

    def reap(self, now: float | None = None) -> None:
        """Expire unclaimed warm VMs and checkouts that never came; prune old records now and then.

        Each step and each job is handled on its own: one record that cannot be saved is logged and
        the rest are still expired.
        """
        service, config = self.service, self.service.config
        now = time.time() if now is None else now
        logged(service.prewarmed.expire, "expiring pre-warmed VMs")
        logged(service.sessions.expire, "expiring idle kept VMs")
        for run in service.runs.all():
            if run.record.state == JobState.AWAITING_CHECKOUT and now - run.record.created_at > config.checkout_wait_seconds:
                if service.queue.discard(run.record.id):
                    logged(service.end_unstarted, f"expiring job {run.record.id}", run, JobState.FAILED,
                           f"no checkout was uploaded within {config.checkout_wait_seconds:g} s")
        if now - self._last_prune > _PRUNE_SECONDS:
            logged(self.prune, "pruning old records", now)

    def prune(self, now: float | None = None) -> list[str]:
        """Apply the retention settings to records and job directories."""
        config = self.service.config
        now = time.time() if now is None else now
        self._last_prune = now
        retention = config.retention
        pruned = self.service.records.prune(now - retention.days * 86400, retention.max_records)
        for job_id in pruned:
            shutil.rmtree(config.jobs_dir / job_id, ignore_errors=True)
        return pruned

    def sweep_job_dirs(self) -> None:
        """Remove job directories no record knows (a crash between mkdir and insert) and stale spools."""
        known = self.service.records.ids()
        for entry in self.service.config.jobs_dir.iterdir():
            if entry.name not in known or not entry.is_dir() or entry.is_symlink():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                continue
            for leftover in (CHECKOUT, f"{CHECKOUT}.part", "artifacts.raw", f"{ARTIFACTS}.part"):
                (entry / leftover).unlink(missing_ok=True)
