"""The job service's core: the job API (admission, checkouts, records, logs, artifacts) and shutdown.

The HTTP layer (`runner.service.api.refusals` and the modules it names) and the in-process `microvm-check run`
both drive this class; it never speaks HTTP itself. Its other roles sit beside it, each given this core by the host
(runner/service/host/assembly.py): the workers (runner/service/jobs/workers.py), the runner desk with the fork
guard (desk.py), the reactions to GitHub's webhooks (reactions.py) and retention (retention.py).

With `bases` (runner/service/jobs/bases.py, built by the host when it has VMs and the GitHub App), a job
of a repository whose trusted file has a `warm:` section restores from that repository's warm base
of the job's network variant instead of the bare default template, and so does a VM pre-warmed for
it; a push to the repository's default branch rebuilds its bases.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from runner.errors import JobError
from runner.jobapi.contract import JOB_ID, Health, JobRecord, JobState, canonical_repository
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.admission import spool_checkout
from runner.service.jobs.auth import OPERATOR, Caller
from runner.service.jobs.job import ARTIFACTS, LOG, Admitted, JobRun
from runner.service.jobs.joblog import JobLog
from runner.service.jobs.jobqueue import QueueClosed
from runner.service.jobs.parts import JobParts
from runner.service.jobs.runs import finish, logged
from runner.service.jobs.sessions import Session

log = logging.getLogger(__name__)

_CANCEL_WAIT_SECONDS = 10.0


class JobNotFound(JobError):
    """No such job (or its records expired), or nothing of it to fetch."""


class JobStateConflict(JobError):
    """The job is not in a state where this request can be done (its checkout is in, it has ended, ...)."""


class JobService:
    def __init__(self, config: ServiceConfig, parts: JobParts) -> None:
        """`parts` (runner/service/jobs/parts.py) are made by the host (runner/service/host/jobs.py) from
        what it reads from disk and the environment: the policies' GitHub source, the access rules with
        the registered runners, the signing key, the check-run reporter, and the VMs jobs run in."""
        self.config = config
        self.policies, self.records, self.attestor = parts.policies, parts.records, parts.attestor
        self.check_runs, self.queue, self.prewarmed = parts.check_runs, parts.queue, parts.prewarmed
        self.sessions, self.access, self.admission = parts.sessions, parts.access, parts.admission
        self.runs, self.vms, self.workers = parts.runs, parts.vms, parts.workers
        self._stopping = threading.Event()
        self._drained = False

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Recover from a predecessor that died (its active jobs fail), then start the workers."""
        failed = self.records.fail_unfinished("the service stopped while this job was active")
        if failed:
            log.warning("marked %d job(s) left active by a previous service failed", len(failed))
        self.workers.start()

    def drain(self, grace_seconds: float | None = None) -> None:
        """Stop taking jobs; give running ones `grace_seconds` to finish, then cancel them; destroy every VM.

        The first half of `close()`, on its own so that the API can go on serving while jobs end (their
        clients see the final records and the ends of the log streams) and stop only after. Runs once.
        """
        if self._drained:
            return
        self._drained = True
        grace = self.config.shutdown_grace_seconds if grace_seconds is None else grace_seconds
        self._stopping.set()
        self.workers.end_keeps("the service is shutting down")  # VMs kept for debugging (docs/debugging.md)
        for job_id in self.queue.close():
            run = self.runs.get(job_id)
            if run:
                logged(self.end_unstarted, f"cancelling job {job_id}", run, JobState.CANCELLED,
                        "the service shut down before the job started")
        self.workers.join(grace)
        for run in self.runs.all():
            run.cancel("the service is shutting down")
        self.workers.join()
        for run in self.runs.all():  # awaiting checkout, never queued
            logged(self.end_unstarted, f"cancelling job {run.record.id}", run, JobState.CANCELLED,
                    "the service shut down before the job started")
        self.sessions.close("the service is shutting down")
        self.prewarmed.close()
        if self.check_runs is not None:
            self.check_runs.close()  # every job has ended: their check runs go out before the service stops

    def close(self) -> None:
        """End every job (`drain` with the configured grace, unless drained already), then release the
        records database: call it after the API has stopped serving."""
        self.drain()
        self.records.close()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the job API -------------------------------------------------------------------------

    def submit(self, data: object) -> JobRecord:
        """The operator's submit (`microvm-check run` in process): `submit_as` without the job token."""
        return self.submit_as(OPERATOR, data)[0]

    def submit_as(self, caller: Caller, data: object,
                  session_token: str | None = None) -> tuple[JobRecord, str, str | None]:
        """Validate, check the caller may submit it, then reserve; whatever fails after the reservation
        releases all of it. Returns the record, the job's own token (runner/service/jobs/auth.py) and, when
        this step opened a `keep: job` session, the session's token (runner/service/jobs/sessions.py):
        a later step attaches to the kept VM only with `session_token`.

        Everything a client sent is checked by `Admission.admit` before anything is spent, so a bad request
        costs no queue slot; past that point a failure (a full disk, SQLite) must not leave a
        reservation, an in-memory job or a directory behind, or the queue shrinks for good.
        """
        if self.stopping:
            raise QueueClosed("the service is shutting down; submit the job again later")
        admitted = self.admission.admit(data, caller)
        spec = admitted.spec
        session, opened = self.admission.session_for(spec, admitted.policy, session_token)
        job_id = "j" + secrets.token_hex(8)
        try:
            # QueueFull / QueueClosed go to the caller (429 / 503); a runner's or a socket member's job has its
            # repository's and its runner's share of the queue (the operator's own jobs are no tenant's)
            tenants = {} if caller.operator else {"repository": canonical_repository(spec.repository), "runner": spec.runner_name}
            self.queue.reserve(job_id, tenants)
        except BaseException:
            if session is not None:
                self.sessions.release(session)
            raise
        try:
            record = self._open_job(job_id, admitted, session)
        except BaseException:
            self._release(job_id)
            if session is not None:
                self.sessions.release(session)
            raise
        return record, self.access.jobs.issue(job_id, caller.runner), opened

    def _open_job(self, job_id: str, admitted: Admitted, session: Session | None = None) -> JobRecord:
        """The job's directory, log and first record; the job becomes visible only once all exist.

        A step that attaches to its job's kept VM sends no checkout (it is in the VM): it is queued at once.
        """
        attached = session is not None and session.sandbox is not None
        spec, policy = admitted.spec, admitted.policy
        job_dir = self.config.jobs_dir / job_id
        record = JobRecord(
            id=job_id, state=JobState.QUEUED if attached else JobState.AWAITING_CHECKOUT, repository=spec.repository,
            sha=spec.sha, run_id=spec.run_id, run_attempt=spec.run_attempt, job_name=spec.job_name,
            policy_digest=policy.digest(), command=spec.command,
            narrowed_egress=self.policies.narrowed(spec.policy, policy),
        )
        if attached:
            record.timings.queued_at = time.time()
        job_dir.mkdir(mode=0o700)
        run = JobRun(record, spec, job_dir, JobLog(job_dir / LOG, self.config.logs), self.records.put, policy,
                     session=session, sessions=self.sessions if session else None, attached=attached,
                     attestor=self.attestor, checks=self.check_runs,
                     secrets=admitted.secrets)
        try:
            self.records.put(record)
        except BaseException:
            run.log.close()
            raise
        self.runs.add(run)
        if attached:
            self.queue.put(job_id)
        return record

    def _release(self, job_id: str) -> None:
        """Undo a submit that failed after its reservation: the slot, the in-memory job, its directory."""
        self.queue.discard(job_id)
        self.runs.pop(job_id)
        shutil.rmtree(self.config.jobs_dir / job_id, ignore_errors=True)

    def put_checkout(self, job_id: str, chunks: Iterable[bytes]) -> JobRecord:
        """Spool the checkout tar into the job's directory, bounded, then queue the job."""
        run = self._need_run(job_id)
        with run.lock:
            if run.record.state != JobState.AWAITING_CHECKOUT or run.uploading or run.cancel_reason:
                raise JobStateConflict(f"job {job_id} is {run.record.state}: "
                                       f"its checkout was already uploaded or it ended")
            run.uploading = True  # only this request writes the checkout
        try:
            spool_checkout(run, chunks, self.config.checkout_max_bytes)
        finally:
            run.uploading = False
        with run.lock:
            if run.record.final or run.cancel_reason:
                run.checkout_path.unlink(missing_ok=True)  # the job's clean-up ran before the checkout landed
                raise JobStateConflict(f"job {job_id} was {run.record.state} while its checkout was uploading")
            run.record.state = JobState.QUEUED
            run.record.timings.queued_at = time.time()
            try:
                self.records.put(run.record)
            except BaseException:  # not queued after all: the job waits for a checkout again, and expires
                run.record.state = JobState.AWAITING_CHECKOUT
                run.record.timings.queued_at = None
                run.checkout_path.unlink(missing_ok=True)
                raise
        try:
            self.queue.put(job_id)
        except (KeyError, QueueClosed):
            self.end_unstarted(run, JobState.CANCELLED, run.cancel_reason or "the service shut down before the job started")
        return run.record

    def cancel(self, job_id: str, reason: str = "cancelled by the client") -> JobRecord:
        kept = self.workers.kept(job_id)
        if kept is not None:  # a failed job's VM kept for debugging: destroyed now, its final record stands
            kept.end_keep(reason)
            return kept.record
        run = self.runs.get(job_id)
        if run is None:
            return self.get(job_id)  # already final: cancel is idempotent
        run.cancel(reason)
        if self.queue.discard(job_id):  # it never reached a worker
            self.end_unstarted(run, JobState.CANCELLED, reason)
        run.done.wait(_CANCEL_WAIT_SECONDS)  # its VM is already destroyed; the worker only writes the record
        return run.record

    def get(self, job_id: str) -> JobRecord:
        run = self.runs.get(job_id)
        if run:
            return run.record
        record = self.records.get(job_id) if JOB_ID.fullmatch(job_id) else None
        if record is None:
            raise JobNotFound(f"no job {job_id!r} (records are kept {self.config.retention.days:g} days)")
        return record

    def run_of(self, job_id: str) -> JobRun:
        """A job that has not ended (its VM, its log); an ended or unknown one is JobStateConflict or JobNotFound."""
        run = self.runs.get(job_id) or self.workers.kept(job_id)  # or a failed job's VM kept for debugging
        if run is None:
            raise JobStateConflict(f"job {job_id} is {self.get(job_id).state.value}: only a running job (or a "
                                   "failed one whose VM is kept for debugging, docs/debugging.md) has a VM to "
                                   "attach to")
        return run

    def list(self, limit: int = 50) -> list[JobRecord]:
        return self.records.list(limit)

    def log_of(self, job_id: str) -> JobLog:
        run = self.runs.get(job_id)
        if run:
            return run.log
        self.get(job_id)  # 404 for unknown ids
        return JobLog.finished(self.config.jobs_dir / job_id / LOG)

    def artifacts_path(self, job_id: str) -> Path:
        record = self.get(job_id)
        if not record.final:
            raise JobStateConflict(f"job {job_id} is {record.state}: artifacts are ready once it has ended")
        path = self.config.jobs_dir / job_id / ARTIFACTS
        if not path.exists():
            raise JobNotFound(f"job {job_id} has no artifacts (none were asked for, matched, or they were rejected)")
        return path

    def attestation(self, job_id: str) -> bytes:
        """The job's signed record (a DSSE envelope line, runner/service/jobs/attestation.py), once it has ended."""
        record = self.get(job_id)
        if not record.final:
            raise JobStateConflict(f"job {job_id} is {record.state}: its record is signed once it has ended")
        try:
            return self.attestor.envelope(self.config.jobs_dir / job_id)
        except FileNotFoundError:
            raise JobNotFound(f"job {job_id} has no signed record (it ended before this service signed records, "
                              "or signing it failed: see the service's log)") from None

    def attestation_key(self) -> str:
        """The PEM public key this service signs job records with."""
        return self.attestor.key.public_pem

    def health(self) -> Health:
        queued, _ = self.queue.counts()
        running = sum(1 for run in self.runs.all() if run.record.state in (JobState.STARTING, JobState.RUNNING))
        return Health(ok=not self.stopping, accel=self.vms.accel, running=running, queued=queued, warm=self.prewarmed.count())

    def end_unstarted(self, run: JobRun, state: JobState, reason: str) -> None:
        """Finish a job no worker holds (it never started); it leaves the service even if its record fails."""
        try:
            finish(run, state, reason)
        finally:
            self.runs.pop(run.record.id)
            if run.session is not None:
                self.sessions.release(run.session)

    def _need_run(self, job_id: str) -> JobRun:
        run = self.runs.get(job_id)
        if run is None:
            self.get(job_id)
            raise JobStateConflict(f"job {job_id} has already ended")
        return run
