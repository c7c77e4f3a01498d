"""The host's ephemeral runners: `min_idle` waiting, at most `max_runners`, one job each, nothing kept.

    fleet = RunnerFleet(FleetSettings.from_config(config), admin, service)
    fleet.start()          # clean up after a predecessor, then keep the runners on a thread of its own
    fleet.prewarm(job)     # webhook: a job for our labels is queued, have a runner ready for it
    fleet.close()          # SIGTERM: take no more jobs, let busy runners finish, deregister the rest

Every runner is registered just in time (`generate-jitconfig`: GitHub removes it after its one job)
and started in a fresh directory as a uid of its own, leased for its life (`runner.fleet.workdir`). One thread
does all the work (GitHub calls, copies, process starts and reaping), so the webhook only records
what it heard and returns at once, and no two steps race over a runner. This module keeps the count
and the state of the runners; what a runner is on the host (its uid, directory, cgroup and process)
is processes.py's, what GitHub still lists registrations.py's, and the status it writes status.py's.

Each runner has its own token, which the service knows (`add_runner`) while the runner lives: its
job hooks and the action in its job use it to report, guard and submit that one job (see
runner/service/jobs/auth.py). Each runner also runs in a cgroup of its own (runner.fleet.cgroup), so
when it ends everything its job started goes with it, `setsid` or not.

What can be lost is made whole again: at start the fleet kills what a dead predecessor's runners
left running, removes their directories and deregisters this host's runners that GitHub still lists;
a runner that exits, with any exit code, has what its job still runs cancelled in the service (its
VMs destroyed, its sessions ended, its tokens revoked) and is replaced; one that exits before taking a
job is replaced after a back-off, and a crash loop is reported (runner.fleet.starts); a busy runner past its
deadline (`job_timeout_seconds` + `deadline_grace_seconds`) is killed, its cgroup with it; a runner
that got no job within `idle_recycle_seconds` is replaced by a fresh one.
"""

from __future__ import annotations

import logging
import secrets
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from runner.fleet import starts, status
from runner.fleet.model import FleetRunner, FleetSettings, RunnerEnd, RunnerState
from runner.fleet.processes import START_ERRORS, RunnerProcesses
from runner.fleet.registrations import Registrations
from runner.github.errors import GitHubError, NotFound
from runner.github.jobs import CompletedJob, QueuedJob
from runner.github.runners import RunnerAdmin
from runner.jobapi.contract import JobStarted

log = logging.getLogger(__name__)

SPAWN_BACKOFF_SECONDS = 10.0  # after GitHub or the host refused a new runner
STOP_WAIT_SECONDS = 5.0  # between SIGTERM and SIGKILL when a runner is retired


class FleetService(Protocol):
    """The job service's side (runner.service.github.desk.RunnerDesk): which runners' tokens it takes, and
    cancelling (destroying the VMs of) a dead runner's jobs. It tells the fleet of each runner's job
    as the runner's hook reports it (`RunnerFleet.runner_bound`)."""

    def add_runner(self, name: str, token: str) -> None: ...

    def remove_runner(self, name: str) -> None: ...

    def runner_died(self, runner_name: str, reason: str) -> list[str]: ...



class RunnerFleet:
    """Keeps the runners' count and states on a thread of its own: starts, binds, reaps, retires."""

    def __init__(self, settings: FleetSettings, admin: RunnerAdmin, service: FleetService,
                 extra_status: Callable[[], dict[str, Any]] | None = None, interval: float = 0.2) -> None:
        self.settings = settings
        self.admin = admin
        self.service = service
        self._extra_status = extra_status
        self._interval = interval
        self._lock = threading.Lock()
        self._runners: list[FleetRunner] = []
        self._pending: dict[int, float] = {}  # queued GitHub job id -> when the webhook said so
        self.registrations = Registrations(admin, settings.org, settings.name_prefix)
        self.processes = RunnerProcesses(settings)
        self.ended: deque[RunnerEnd] = deque(maxlen=200)
        self._retry_at = 0.0
        self.failed_starts = starts.StartFailures()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life cycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Check that runners can see what they run, the user and the installed release, clean up after
        a predecessor, start the thread."""
        self.processes.prepare()
        self._thread = threading.Thread(target=self._loop, name="runner-fleet", daemon=True)
        self._thread.start()

    def close(self, grace_seconds: float | None = None) -> None:
        """Take no more jobs; busy runners get `grace_seconds` (default: the config's) to finish, then
        they are stopped and their jobs cancelled; idle runners are deregistered. Safe to call twice."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        grace = self.settings.shutdown_grace_seconds if grace_seconds is None else grace_seconds
        for runner in self.runners():
            if runner.state is RunnerState.IDLE:
                self._retire(runner, "the service is shutting down", force=True)
        deadline = time.monotonic() + grace
        while self.runners() and time.monotonic() < deadline:
            self.tick()
            time.sleep(min(self._interval, max(0.0, deadline - time.monotonic())))
        for runner in self.runners():
            self.processes.kill(runner)
            self._reap(runner, runner.process.wait())
        self.registrations.retry()
        self.processes.close()
        status.write(self.settings.status_path, self.status())

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    # -- JobHooks (runner.github.jobs): called on the webhook's thread, so they only take note -----

    def prewarm(self, job: QueuedJob) -> None:
        """A job for our labels is queued: have an idle runner for it (up to max_runners)."""
        if self.stopping:
            return
        with self._lock:
            self._pending.setdefault(int(job.job_id), time.time())
        self._wake.set()

    def job_completed(self, job: CompletedJob) -> None:
        """The job ended, on whichever host took it: it no longer needs a runner here."""
        with self._lock:
            self._pending.pop(int(job.job_id), None)
        self._wake.set()

    # -- what there is -----------------------------------------------------------------------------

    def runners(self) -> list[FleetRunner]:
        with self._lock:
            return list(self._runners)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def status(self) -> dict[str, Any]:
        data: dict[str, Any] = {"updated_at": time.time(), "org": self.settings.org,
                                "labels": list(self.settings.labels), "max_runners": self.settings.max_runners,
                                "min_idle": self.settings.min_idle, "stopping": self.stopping,
                                "runners": [r.view() for r in self.runners()], "pending_jobs": self.pending(),
                                "to_deregister": self.registrations.stale, "crash_loop": self.crash_loop()}
        if self._extra_status is not None:
            data.update(self._extra_status())
        return data

    def crash_loop(self) -> dict[str, Any] | None:
        """What `status` says while runners keep ending before they take a job (runner.fleet.starts)."""
        return self.failed_starts.crash_loop(self._retry_at)

    # -- the fleet's thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # one failed pass must not end the fleet
                log.exception("the runner fleet's pass failed; it runs again")
            self._wake.wait(self._interval)
            self._wake.clear()

    def tick(self) -> None:
        """One pass: reap and inspect every runner, retry deregistrations, scale, write the status."""
        now = time.time()
        for runner in self.runners():
            self._inspect(runner, now)
        if not self.registrations.swept:
            self.registrations.sweep(runner.github_id for runner in self.runners())
        self.registrations.retry()
        self._expire_pending(now)
        if not self.stopping:
            self._scale(now)
        status.write(self.settings.status_path, self.status())

    def _inspect(self, runner: FleetRunner, now: float) -> None:
        exit_code = runner.process.poll()
        if exit_code is not None:
            failure = None if runner.job is not None else starts.StartFailure(
                runner.name, exit_code, runner.since, now, starts.last_output(runner.output))
            self._reap(runner, exit_code, ended_at=now)
            if failure is not None:
                self._failed_start(failure)
        elif runner.state is RunnerState.IDLE and now - runner.since > self.settings.idle_recycle_seconds:
            self._retire(runner, f"no job in {self.settings.idle_recycle_seconds:g} s")
        elif runner.state is RunnerState.BUSY and now - runner.since > self.deadline_seconds:
            self._expire(runner)

    @property
    def deadline_seconds(self) -> float:
        """How long a busy runner may live: its job's timeout plus a grace, counted from its job's report."""
        return self.settings.job_timeout_seconds + self.settings.deadline_grace_seconds

    def _expire(self, runner: FleetRunner) -> None:
        """A busy runner past its deadline (stopped, hung, or a job that never ends): SIGKILL reaches it
        stopped or not, with everything its job started (its cgroup), and what its job still runs in
        the service fails with the reason."""
        why = (f"runner {runner.name} passed its deadline (job timeout {self.settings.job_timeout_seconds:g} s + "
               f"grace {self.settings.deadline_grace_seconds:g} s): it was killed with everything its job started")
        log.warning("%s", why)
        self.processes.kill(runner)
        self._reap(runner, runner.process.wait(), why)

    def _failed_start(self, failure: starts.StartFailure) -> None:
        """The runner ended before taking a job: the next start waits, longer for each in a row, and from
        starts.CRASH_LOOP_TRIES in a row on the log says it is a crash loop (so do `status` and the metrics)."""
        delay = self.failed_starts.failed(failure)
        self._retry_at = max(self._retry_at, failure.ended_at + delay)
        report = self.crash_loop()
        if report is not None:
            log.error("runners cannot start (%s); the next try in %g s", report["reason"], delay)
        else:
            log.warning("%s; the next runner starts in %g s", failure.describe(), delay)

    def runner_bound(self, name: str, job: JobStarted) -> None:
        """The service bound runner `name` to the job its hook reported: it is busy from now on."""
        for runner in self.runners():
            if runner.name == name and runner.state is RunnerState.IDLE:
                self._busy(runner, job, time.time())

    def _busy(self, runner: FleetRunner, job: JobStarted, now: float) -> None:
        self.failed_starts.took_job()
        with self._lock:
            runner.state, runner.job, runner.since = RunnerState.BUSY, job, now
            if self._pending:  # one queued job fewer waits for a runner (which one GitHub knows)
                self._pending.pop(min(self._pending, key=self._pending.__getitem__))
        log.info("runner %s took %s", runner.name, job.describe())

    def _reap(self, runner: FleetRunner, exit_code: int, why: str | None = None, ended_at: float | None = None) -> None:
        """The runner's process ended: stop what it left, and whatever its job still runs in the service
        is cancelled (VMs destroyed, sessions ended, tokens revoked) whatever the exit code: a job may
        have killed its own job-completed hook and exited 0. Deregister it if GitHub did not (a JIT
        runner is removed by GitHub only after a job it finished)."""
        self.processes.kill(runner)
        died = runner.job is not None and exit_code != 0
        if runner.job is not None:
            why = why or (f"the runner {runner.name} running this job ended ({starts.exit_text(exit_code)}) while this job "
                          "still ran: the job ends with its runner and its VM was destroyed" +
                          ("; re-run the job" if died else ""))
            if died:
                log.warning("runner %s died during %s (%s)", runner.name, runner.job.describe(), starts.exit_text(exit_code))
            cancelled = self.service.runner_died(runner.name, why)
            if cancelled and not died:
                log.warning("runner %s ended %s, but its job still ran %s: cancelled", runner.name,
                            starts.exit_text(exit_code), ", ".join(cancelled))
        if runner.job is None or exit_code != 0:
            self.registrations.deregister(runner.github_id)
        self._forget(runner)
        self.ended.append(RunnerEnd(runner.name, runner.job, exit_code, died, runner.since,
                                    time.time() if ended_at is None else ended_at))

    def _retire(self, runner: FleetRunner, why: str, force: bool = False) -> None:
        """Replace an idle runner. Deregistered first: GitHub refuses that for a runner it just gave a
        job, and then the runner is left to do it (unless the service is shutting down)."""
        try:
            self.admin.delete(runner.github_id)
        except NotFound:
            pass
        except GitHubError as exc:
            if not force:
                log.info("runner %s not retired (%s): GitHub says %s", runner.name, why, exc)
                return
            self.registrations.note(runner.github_id)
        log.info("retiring runner %s: %s", runner.name, why)
        self.processes.kill(runner, signal.SIGTERM)
        try:
            runner.process.wait(STOP_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        self.processes.kill(runner)
        runner.process.wait()
        self._forget(runner)
        self.ended.append(RunnerEnd(runner.name, runner.job, None, False, runner.since, time.time()))

    def _scale(self, now: float) -> None:
        with self._lock:
            idle = [r for r in self._runners if r.state is RunnerState.IDLE]
            total, want = len(self._runners), max(self.settings.min_idle, len(self._pending))
        for surplus in sorted(idle, key=lambda r: r.since)[want:]:
            self._retire(surplus, "more idle runners than jobs waiting")
        missing = min(want - len(idle), self.settings.max_runners - total)
        for _ in range(max(0, missing)):
            if now < self._retry_at or not self._spawn(now):
                return

    def _forget(self, runner: FleetRunner) -> None:
        """The runner has ended: its token opens nothing, its cgroup (whatever its job left running)
        and its directory are gone."""
        self.service.remove_runner(runner.name)
        self.processes.remove(runner)
        with self._lock:
            self._runners.remove(runner)

    def _spawn(self, now: float) -> bool:
        name = f"{self.settings.name_prefix}-{secrets.token_hex(4)}"
        try:
            jit = self.admin.jit_config(name, self.settings.labels, self.settings.runner_group)
        except GitHubError as exc:
            log.error("cannot register a runner with org %s (trying again in %g s): %s",
                      self.settings.org, SPAWN_BACKOFF_SECONDS, exc)
            self._retry_at = now + SPAWN_BACKOFF_SECONDS
            return False
        token = secrets.token_urlsafe(32)
        self.service.add_runner(name, token)
        try:
            runner = self.processes.start(name, jit, token, now)
        except START_ERRORS as exc:
            log.error("cannot start runner %s in %s (trying again in %g s): %s", name,
                      self.settings.runners_dir / name, SPAWN_BACKOFF_SECONDS, exc)
            self.service.remove_runner(name)
            self.registrations.deregister(jit.runner.id)
            self._retry_at = now + SPAWN_BACKOFF_SECONDS
            return False
        with self._lock:
            self._runners.append(runner)
        assert runner.identity is not None  # a started runner has its own uid
        log.info("runner %s (id %d, uid %d) started in %s", name, jit.runner.id, runner.identity.uid, runner.dir.path)
        return True

    def _expire_pending(self, now: float) -> None:
        with self._lock:
            for job_id, queued_at in list(self._pending.items()):
                if now - queued_at > self.settings.idle_recycle_seconds:
                    del self._pending[job_id]
