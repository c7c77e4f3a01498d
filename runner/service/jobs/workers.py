"""The worker pool: each worker takes a queued job, chooses the template its VM restores from and runs it.

`JobVMs` is how a job's VM is made (the host's sandbox factory, and the repositories' warm bases that
`choose_template` may pick from); the workers and the pre-warming reactions both use it, so a pre-warmed
VM and the submit that claims it choose the same template.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from runner.jobapi.contract import JobState
from runner.sandbox.port import SandboxFactory, SandboxLike, TemplateChoice, VMRequest
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.debugkeep import debug_seconds, refusal
from runner.service.jobs.egress import EgressPolicies
from runner.service.jobs.job import JobRun
from runner.service.jobs.jobqueue import JobQueue
from runner.service.jobs.prewarm import PrewarmedVMs
from runner.service.jobs.runs import ActiveRuns, finish
from runner.service.jobs.sessions import Sessions
from runner.service.jobs.templatechoice import choose_template

if TYPE_CHECKING:
    from runner.service.jobs.bases import RepositoryBases

log = logging.getLogger(__name__)


class JobVMs:
    """The host's sandbox factory, the repositories' warm bases (None: every job restores from the
    template it names), and the accelerator the last VM reported (for health)."""

    def __init__(self, create: SandboxFactory, bases: RepositoryBases | None) -> None:
        self._create = create
        self.bases = bases
        self.accel: str | None = None

    def create(self, request: VMRequest) -> SandboxLike:
        sandbox = self._create(request)
        self.accel = sandbox.accel
        return sandbox


class Workers:
    """`config.max_concurrent_jobs` threads, one job at a time each, until the queue closes."""

    def __init__(self, config: ServiceConfig, queue: JobQueue, runs: ActiveRuns, vms: JobVMs,
                 prewarmed: PrewarmedVMs, sessions: Sessions, policies: EgressPolicies | None = None) -> None:
        self.config, self.queue, self.runs, self.vms = config, queue, runs, vms
        self.prewarmed, self.sessions = prewarmed, sessions
        self.policies = policies  # the repositories' trusted files: their `debug:` keep (None: the config's alone)
        self._threads: list[threading.Thread] = []
        # Failed jobs whose VM is kept for debugging, by id: out of `runs` (they run nothing a GitHub job's end
        # or a runner's death must cancel), each holding its worker until `end_keep` or its time is up.
        self._kept: dict[str, JobRun] = {}
        self._kept_lock = threading.Lock()
        self._closing = False  # end_keeps was called: a job kept from now on ends its keep at once

    def kept(self, job_id: str) -> JobRun | None:
        """The finished job `job_id` whose VM is kept for debugging (`jobs attach`, `jobs cancel`), or None."""
        with self._kept_lock:
            return self._kept.get(job_id)

    def end_keeps(self, why: str) -> None:
        """Destroy every VM kept for debugging (the service's shutdown)."""
        with self._kept_lock:
            self._closing = True
            kept = list(self._kept.values())
        for run in kept:
            run.end_keep(why)

    def start(self) -> None:
        for n in range(self.config.max_concurrent_jobs):
            worker = threading.Thread(target=self._work, name=f"job-worker-{n}", daemon=True)
            worker.start()
            self._threads.append(worker)

    def join(self, timeout: float | None = None) -> None:
        """Wait for every worker to end (the queue is closed), all of them within `timeout` seconds."""
        if timeout is None:
            for worker in self._threads:
                worker.join()
            return
        deadline = time.monotonic() + timeout
        for worker in self._threads:
            worker.join(max(0.0, deadline - time.monotonic()))

    def _work(self) -> None:
        """A worker: one job at a time until the queue closes; no job can end the worker."""
        while True:
            job_id = self.queue.get()
            if job_id is None:
                return
            try:
                self._work_on(job_id)
            finally:
                self.queue.finished(job_id)  # its repository may run another

    def _work_on(self, job_id: str) -> None:
        run = self.runs.get(job_id)
        if run is None:
            return
        try:
            choice = self._choose_template(run)
            self._debug_keep(run)
            if run.session is None and not run.debug_seconds:  # a kept VM outlives a pre-warmed VM's TTL
                self._claim_warm(run, choice)
            run.on_kept = lambda: self._keep(run)
            run.execute(self.vms.create, self.config, choice)
        except Exception:  # execute never raises by design; a record that cannot be saved still might
            log.exception("job %s: the worker failed outside the job's own handling", job_id)
            self._abandon(run)
        finally:
            self.runs.pop(job_id)
            with self._kept_lock:
                self._kept.pop(job_id, None)

    def _keep(self, run: JobRun) -> None:
        with self._kept_lock:
            self._kept[run.record.id] = run
            closing = self._closing
        self.runs.pop(run.record.id)
        if closing:
            run.debug_end.set()

    def _choose_template(self, run: JobRun) -> TemplateChoice:
        """The template the job's VM restores from; a step that attaches to its job's kept VM has the
        choice the first step made, which the session keeps for the steps after it."""
        session, spec = run.session, run.spec
        kept = session.choice if session is not None and run.attached else None
        if kept is not None:
            return kept
        choice = choose_template(spec.template, size=spec.size, repository=spec.repository, policy=run.policy,
                                 bases=self.vms.bases)
        if session is not None:
            session.choice = choice
        return choice

    def _debug_keep(self, run: JobRun) -> None:
        """How long the job's VM is kept should it fail (runner/service/jobs/debugkeep.py), asked of the
        trusted side before its VM starts (the VM's engine TTL allows for it)."""
        policies = self.policies or EgressPolicies(self.config.policy_dir)
        run.debug_seconds = debug_seconds(self.config, policies, run.spec.repository)
        checkout, config = run.checkout_path, self.config
        run.debug_refusal = lambda: refusal(config, checkout) if checkout.exists() else None

    def _claim_warm(self, run: JobRun, choice: TemplateChoice) -> None:
        spec = run.spec
        if spec.github is not None:
            run.prewarmed = self.prewarmed.claim(spec.github, choice.template, run.record.policy_digest or "")
            if run.prewarmed is not None:
                run.update(warm=True)

    def _abandon(self, run: JobRun) -> None:
        """Destroy whatever VM a job that failed outside `execute` holds, and end it, best effort."""
        for sandbox in {id(s): s for s in (run.prewarmed, run.sandbox) if s is not None}.values():
            try:
                sandbox.destroy()
            except Exception:
                log.exception("job %s: destroying VM %s failed", run.record.id, sandbox.id)
        if run.session is not None:
            self.sessions.end(run.session, "the service failed to run a step of the job")
        try:
            finish(run, JobState.FAILED, "the service failed to run this job; see the service log")
        except Exception:
            log.exception("job %s: its final record could not be saved", run.record.id)

