"""The job service: admission, the worker pool, records, pre-warming and shutdown.

The HTTP layer (`runner.service.api`) and the in-process `microvm-check run` both drive this class;
it never speaks HTTP itself. It also implements the GitHub webhook's `JobHooks` protocol
(`prewarm`, `job_completed`, `default_branch_pushed`).

With `bases` (runner/service/bases.py, built by the host when it has VMs and the GitHub App), a job
of a repository whose trusted file has a `warm:` section restores from that repository's warm base
of the job's network variant instead of the bare default template, and so does a VM pre-warmed for
it; a push to the repository's default branch rebuilds its bases.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from policy.model import Policy
from runner.attest.keys import SigningKey
from runner.errors import ArchiveError, ConfigError, JobError
from runner.fleet import registered, report
from runner.fleet.report import ReportedJob
from runner.jobapi.contract import (
    JOB_ID,
    Health,
    JobRecord,
    JobSpec,
    JobStarted,
    JobState,
    Verdict,
    canonical_repository,
)
from runner.logs import JobEvents
from runner.sandbox.port import SandboxFactory, SandboxLike, VMRequest, needs_network
from runner.service.attestation import ENVELOPE, JobAttestor
from runner.service.auth import OPERATOR, Access, Caller
from runner.service.checkruns import CheckRunReporter
from runner.service.config import ServiceConfig
from runner.service.egress import EgressPolicies, EgressPolicyError, PolicySourceUnavailable
from runner.service.job import ARTIFACTS, CHECKOUT, LOG, JobRun, vm_request
from runner.service.joblog import JobLog
from runner.service.jobqueue import JobQueue, QueueClosed
from runner.service.records import RecordStore
from runner.service.sessions import Session, SessionKey, Sessions, parse_keep, session_key
from runner.service.spec import SpecError, parse_spec
from runner.service.warm import PrewarmedVMs, RunKey
from runner.tarsafe import check_tar
from runner.vm.templates import sized

if TYPE_CHECKING:
    from runner.github.client import GitHubClient
    from runner.github.guard import RepoRules
    from runner.github.jobs import CompletedJob, Push, QueuedJob
    from runner.github.policy_source import PolicySource
    from runner.service.bases import RepositoryBases

log = logging.getLogger(__name__)

_REAP_SECONDS = 5.0
_PRUNE_SECONDS = 3600.0
_CANCEL_WAIT_SECONDS = 10.0


class InvalidJob(JobError):
    """The job as sent cannot run here: its spec, its egress policy or its checkout."""


class JobNotFound(JobError):
    """No such job (or its records expired), or nothing of it to fetch."""


class JobStateConflict(JobError):
    """The job is not in a state where this request can be done (its checkout is in, it has ended, ...)."""


class TooLarge(JobError):
    """A request body over the service's limit for it."""


def check_run_reporter(config: ServiceConfig, keyid: str) -> CheckRunReporter | None:
    """The pull requests' check runs, posted as the GitHub App; None without the App or a policy store
    (whose repository files say which repositories want them)."""
    if config.github_config is None or config.policy_dir is None:
        return None
    from policy import PolicyStore
    from runner.github.checks import CheckRuns
    from runner.github.config import load_settings

    path = config.github_config
    return CheckRunReporter(lambda: CheckRuns(load_settings(path).app().as_installation),
                            PolicyStore(config.policy_dir), config.public_url, keyid)


def branch_files(config: ServiceConfig) -> PolicySource | None:
    """The repositories' own policy files, read as the org's GitHub App; None without App settings."""
    if config.github_config is None:
        return None
    from runner.github.config import load_settings
    from runner.github.errors import GitHubError
    from runner.github.policy_source import PolicySource

    try:
        return PolicySource(load_settings(config.github_config).app().as_installation)
    except GitHubError as exc:
        raise ConfigError(f"github_config: {exc}") from exc


class JobService:
    def __init__(self, config: ServiceConfig, create_sandbox: SandboxFactory,
                 policies: EgressPolicies | None = None, bases: RepositoryBases | None = None) -> None:
        """`create_sandbox` makes a job's VM from its `VMRequest`: the engine its owner built
        (`runner.service.host.ServiceHost`) as a `SandboxProvider`, or a stand-in in tests; `bases` the repositories' warm
        bases on that engine (None: every job restores from the template it names)."""
        self.config = config
        self._create = create_sandbox
        self.bases = bases
        self.policies = policies or EgressPolicies(config.policy_dir, branch_files=branch_files(config))
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # job logs and artifacts: not for other users
        config.jobs_dir.mkdir(exist_ok=True, mode=0o700)
        self.records = RecordStore(config.records_path)
        self.attestor = JobAttestor(SigningKey.load_or_create(config.attestation_key_path))
        self.check_runs = check_run_reporter(config, self.attestor.key.keyid)
        self.queue = JobQueue(config.max_queued_jobs, max_queued=_queue_shares(config), max_running={
            "repository": config.max_running_per_repository or config.max_concurrent_jobs})
        self.warm = PrewarmedVMs(config.prewarm.max_vms, config.prewarm.expire_seconds)
        self.sessions = Sessions(_destroy_vm)  # `keep: job`: one VM across a GitHub job's steps
        if isinstance(self.records.events, JobEvents):  # a kept VM's step says "kept", not "destroyed"
            self.records.events.kept = self.sessions.holds
        self.accel: str | None = None
        self.access = Access(config.admin_group, fleet=config.runners.org is not None,
                             local_repository=config.local_jobs.repository,
                             registered=registered.load(config.state_dir),
                             binding_seconds=config.runners.job_timeout_seconds + config.runners.deadline_grace_seconds,
                             hook_ends_binding=config.webhook.listen is None)
        self._runs: dict[str, JobRun] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._drained = False
        self._workers: list[threading.Thread] = []
        self._reaper: threading.Thread | None = None
        self._last_prune = 0.0

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Recover from a predecessor that died, then start workers and the reaper."""
        failed = self.records.fail_unfinished("the service stopped while this job was active")
        if failed:
            log.warning("marked %d job(s) left active by a previous service failed", len(failed))
        self._sweep_job_dirs()
        self.prune()
        for n in range(self.config.max_concurrent_jobs):
            worker = threading.Thread(target=self._work, name=f"job-worker-{n}", daemon=True)
            worker.start()
            self._workers.append(worker)
        self._reaper = threading.Thread(target=self._reap, name="job-reaper", daemon=True)
        self._reaper.start()

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
        for job_id in self.queue.close():
            run = self._run(job_id)
            if run:
                _logged(self._end, f"cancelling job {job_id}", run, JobState.CANCELLED,
                        "the service shut down before the job started")
        deadline = time.monotonic() + grace
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for run in self._active_runs():
            run.cancel("the service is shutting down")
        for worker in self._workers:
            worker.join()
        for run in self._active_runs():  # awaiting checkout, never queued
            _logged(self._end, f"cancelling job {run.record.id}", run, JobState.CANCELLED,
                    "the service shut down before the job started")
        self.sessions.close("the service is shutting down")
        self.warm.close()
        if self._reaper:
            self._reaper.join()
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
        releases all of it. Returns the record, the job's own token (runner/service/auth.py) and, when
        this step opened a `keep: job` session, the session's token (runner/service/sessions.py):
        a later step attaches to the kept VM only with `session_token`.

        Everything a client sent is checked by `_admit` before anything is spent, so a bad request
        costs no queue slot; past that point a failure (a full disk, SQLite) must not leave a
        reservation, an in-memory job or a directory behind, or the queue shrinks for good.
        """
        spec, policy = self._admit(data, caller)
        session, opened = self._join_session(spec, policy, session_token)
        job_id = "j" + secrets.token_hex(8)
        try:
            # QueueFull / QueueClosed go to the caller (429 / 503); a runner's or a socket member's job has its
            # repository's and its runner's share of the queue (the operator's own jobs are no tenant's)
            tenants = {} if caller.operator else {"repository": spec.repository.lower(), "runner": spec.runner_name}
            self.queue.reserve(job_id, tenants)
        except BaseException:
            if session is not None:
                self.sessions.release(session)
            raise
        try:
            record = self._open_job(job_id, spec, policy, session)
        except BaseException:
            self._release(job_id)
            if session is not None:
                self.sessions.release(session)
            raise
        return record, self.access.jobs.issue(job_id, caller.runner), opened

    def _join_session(self, spec: JobSpec, policy: Policy,
                      token: str | None) -> tuple[Session | None, str | None]:
        """The GitHub job's kept VM this step opens (`keep: job` without a session's token: a new
        session and its token) or attaches to (the token of a session of this very job), or None.
        The key carries the runner the binding admitted and the token only the job has, so no other
        job finds it, whatever it claims."""
        key = session_key(spec)
        if key is None:
            if spec.keep == "job":
                raise InvalidJob("keep: job needs the GitHub job's run_id and job_name (the action sends them)")
            return None, None
        return self.sessions.join(key, spec.keep, spec.template or "", policy.digest(), token)

    def _admit(self, data: object, caller: Caller) -> tuple[JobSpec, Policy]:
        """The validated spec and its effective policy, or a JobError; reserves nothing. The caller is
        checked before the policy is looked up: the policy comes from the repository it may submit for."""
        if self.stopping:
            raise QueueClosed("the service is shutting down; submit the job again later")
        try:
            spec = parse_spec(data, self.config)
            runner = self.access.admit_submit(caller, spec)
            spec = dataclasses.replace(spec, runner_name=runner or "", keep=parse_keep(data))
            # the name GitHub gave the runner (not the submit's spelling of it), or the local jobs' name
            spec = dataclasses.replace(spec, repository=self.access.repository_for(caller, spec))
            policy = self.policies.effective(spec.repository, spec.policy)
            spec = self._sized(spec)
        except PolicySourceUnavailable:
            raise  # GitHub is down: 503, try again (not an invalid job)
        except (SpecError, EgressPolicyError) as exc:
            raise InvalidJob(f"invalid job: {exc}") from exc
        if needs_network(policy) and not self.config.network.enabled:
            raise InvalidJob(f"the egress policy for {spec.repository} allows network access, but this service "
                             f"runs VMs without networking (network.enabled is false in its config): narrow the "
                             f"policy to deny all, or ask the operator to enable networking")
        return spec, policy

    def _sized(self, spec: JobSpec) -> JobSpec:
        """A spec asking for a size class restores from its template baked at that size, if the
        repository's store file allows the size (a pull request's spec cannot widen that)."""
        if spec.size is None:
            return spec
        allowed = self.policies.sizes_for(spec.repository)
        if spec.size not in allowed:
            raise InvalidJob(f"size: {spec.repository} may not use the size {spec.size!r} (its store file allows "
                             f"{', '.join(allowed) or 'no sizes'}): the operator lists a repository's sizes in its "
                             f"store file (<owner>/<repo>.yml, sizes: [{spec.size}]), or leave size out")
        return dataclasses.replace(spec, template=sized(_template_of(spec), spec.size))

    def _open_job(self, job_id: str, spec: JobSpec, policy: Policy, session: Session | None = None) -> JobRecord:
        """The job's directory, log and first record; the job becomes visible only once all exist.

        A step that attaches to its job's kept VM sends no checkout (it is in the VM): it is queued at once.
        """
        attached = session is not None and session.sandbox is not None
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
                     attestor=self.attestor, checks=self.check_runs)
        try:
            self.records.put(record)
        except BaseException:
            run.log.close()
            raise
        with self._lock:
            self._runs[job_id] = run
        if attached:
            self.queue.put(job_id)
        return record

    def _release(self, job_id: str) -> None:
        """Undo a submit that failed after its reservation: the slot, the in-memory job, its directory."""
        self.queue.discard(job_id)
        with self._lock:
            self._runs.pop(job_id, None)
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
            self._spool(run, chunks)
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
            self._end(run, JobState.CANCELLED, run.cancel_reason or "the service shut down before the job started")
        return run.record

    def _spool(self, run: JobRun, chunks: Iterable[bytes]) -> None:
        part = run.dir / f"{CHECKOUT}.part"
        limit = self.config.checkout_max_bytes
        written = 0
        try:
            with open(part, "wb") as out:
                for chunk in chunks:
                    written += len(chunk)
                    if written > limit:
                        raise TooLarge(f"the checkout is larger than the service's limit of {limit} bytes; "
                                       f"leave build outputs out or ask the operator to raise checkout_max_bytes")
                    out.write(chunk)
            with open(part, "rb") as check:
                check_tar(check)
            os.replace(part, run.checkout_path)
        except ArchiveError as exc:
            raise InvalidJob(f"checkout: {exc}") from exc
        finally:
            if part.exists():
                part.unlink()

    def cancel(self, job_id: str, reason: str = "cancelled by the client") -> JobRecord:
        run = self._run(job_id)
        if run is None:
            return self.get(job_id)  # already final: cancel is idempotent
        run.cancel(reason)
        if self.queue.discard(job_id):  # it never reached a worker
            self._end(run, JobState.CANCELLED, reason)
        run.done.wait(_CANCEL_WAIT_SECONDS)  # its VM is already destroyed; the worker only writes the record
        return run.record

    def get(self, job_id: str) -> JobRecord:
        run = self._run(job_id)
        if run:
            return run.record
        record = self.records.get(job_id) if JOB_ID.fullmatch(job_id) else None
        if record is None:
            raise JobNotFound(f"no job {job_id!r} (records are kept {self.config.retention.days:g} days)")
        return record

    def list(self, limit: int = 50) -> list[JobRecord]:
        return self.records.list(limit)

    def log_of(self, job_id: str) -> JobLog:
        run = self._run(job_id)
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
        """The job's signed record (a DSSE envelope line, runner/service/attestation.py), once it has ended."""
        record = self.get(job_id)
        if not record.final:
            raise JobStateConflict(f"job {job_id} is {record.state}: its record is signed once it has ended")
        try:
            return (self.config.jobs_dir / job_id / ENVELOPE).read_bytes()
        except FileNotFoundError:
            raise JobNotFound(f"job {job_id} has no signed record (it ended before this service signed records, "
                              "or signing it failed: see the service's log)") from None

    def attestation_key(self) -> str:
        """The PEM public key this service signs job records with."""
        return self.attestor.key.public_pem

    def health(self) -> Health:
        queued, _ = self.queue.counts()
        running = sum(1 for run in self._active_runs() if run.record.state in (JobState.STARTING, JobState.RUNNING))
        return Health(ok=not self.stopping, accel=self.accel, running=running, queued=queued, warm=self.warm.count())

    # -- JobHooks (runner.github.jobs) ----------------------------------------------------------

    def prewarm(self, job: QueuedJob) -> None:
        """Restore a VM for a queued GitHub job ahead of its submit (best effort, bounded), from the
        template its submit will restore from: the repository's warm base, chosen in the background."""
        if self.stopping:
            return
        template = self.config.default_template
        try:
            policy = self.policies.effective(job.repository, None)
        except EgressPolicyError as exc:  # the policy's own message says what to fix; the stack only at DEBUG
            log.warning("not pre-warming for %s: its policy does not load: %s", job.repository, exc)
            log.debug("not pre-warming for %s", job.repository, exc_info=True)
            return
        if needs_network(policy) and not self.config.network.enabled:
            return  # its submit will be refused: see submit()
        key = RunKey(canonical_repository(job.repository), job.run_id, job.run_attempt)
        self.warm.prewarm(key, job.job_id, policy.digest(),
                          lambda: self._template_for(job.repository, template, policy),
                          lambda chosen: self._create_vm(vm_request(
            self.config, template=chosen,
            ttl_seconds=int(self.config.prewarm.expire_seconds) + self.config.max_timeout_seconds,
            policy=policy, job_id=f"warm-{job.job_id}")))

    def job_completed(self, job: CompletedJob) -> None:
        """GitHub says the job ended: whatever still runs or waits for it is cancelled and its VM destroyed."""
        key = RunKey(canonical_repository(job.repository), job.run_id, job.run_attempt)
        self.warm.discard_job(key, job.job_id)
        why = f"GitHub reports the job completed ({job.conclusion or 'no conclusion'})"
        for run in self._active_runs():
            if _same_github_job(run.spec, job):
                self.cancel(run.record.id, why)
        self.sessions.end_where(lambda session: _session_of_github_job(session, job), why)
        bound = self.access.runners.job_of(job.runner_name) if job.runner_name else None
        if bound is not None and job.runner_name and _reported_is(bound, job):
            self.access.end_runner_job(job.runner_name)  # its token submits nothing after `completed`

    def default_branch_pushed(self, push: Push) -> None:
        """GitHub says the repository's default branch moved: its warm bases are stale, rebuild them
        from the pushed commit (in the background; jobs keep the last good base meanwhile)."""
        if self.bases is None or self.stopping:
            return
        rebuilt = self.bases.pushed(canonical_repository(push.repository), push.after)
        if rebuilt:
            log.info("push to %s's default branch (%s): rebuilding its warm bases", push.repository, push.after[:12])

    # -- the fleet's runners (runner.fleet) and their job hooks ----------------------------------------

    def add_runner(self, name: str, token: str) -> None:
        """A fleet runner starts: its token (in its `.env`) lets it report and submit its one job."""
        self.access.runners.add(name, token)

    def remove_runner(self, name: str) -> None:
        """A fleet runner ended: its token opens nothing any more."""
        self.access.runners.remove(name)

    def runner_job(self, name: str) -> ReportedJob | None:
        """The job the runner's hook reported (runner -> current job), for the fleet's status."""
        return self.access.runners.job_of(name)

    def runner_job_started(self, runner: str, started: JobStarted) -> Verdict:
        """A runner's job-started hook: remember its job (what it may submit), then run the fork guard
        here, with the App the runner user must not reach. Its verdict is what the hook prints."""
        job = report.parse({k: v for k, v in started.to_wire().items() if k != "guard"})
        if job is None:
            raise InvalidJob("the reported job is not a job: repository, run_id, run_attempt and job are required")
        self.access.runners.bind(runner, job)
        log.info("runner %s took %s", runner, job.describe())
        from runner.github import guard
        from runner.github.errors import GitHubError

        try:
            rules = self._guard_rules(job.repository)
        except GitHubError as exc:
            return Verdict(False, (f"the guard's rules could not be read ({exc}), so it refuses the job.",))
        verdict = guard.service_verdict(started.guard, job.repository, rules, self._github_client)
        if not verdict.allowed:
            log.warning("runner %s: the fork guard refused %s: %s", runner, job.describe(), " ".join(verdict.reasons))
        return Verdict(verdict.allowed, verdict.reasons)

    def runner_job_completed(self, runner: str) -> builtins.list[str]:
        """A runner's job-completed hook: whatever its job still runs is cancelled and its VM destroyed."""
        ids = [run.record.id for run in self._active_runs() if run.spec.runner_name == runner]
        for job_id in ids:
            self.cancel(job_id, f"the GitHub job ended (runner {runner}'s job-completed hook) while this job still ran")
        self.sessions.end_where(lambda key: key.runner == runner, f"runner {runner}'s job-completed hook")
        self.access.end_runner_job(runner, by_hook=True)
        return ids

    def _guard_rules(self, repository: str) -> RepoRules:
        """The guard's per-repository rules: the file $MICROVM_CHECK_GUARD_RULES names, else none."""
        from runner.github import guard
        from runner.github.guard import GUARD_RULES_ENV

        path = os.environ.get(GUARD_RULES_ENV)
        return guard.load_rules(Path(path) if path else None).for_repository(repository)

    def _github_client(self) -> GitHubClient:
        """The App's installation client, made only when the guard needs GitHub (a fork pull request)."""
        from runner.github.config import load_settings
        from runner.github.errors import GitHubError

        path = self.config.runners.github_config or self.config.github_config
        if path is None:
            raise GitHubError("the service has no GitHub App settings (github_config) to check fork pull requests with")
        return load_settings(path).app().as_installation

    def runner_died(self, runner_name: str, reason: str) -> builtins.list[str]:
        """The runner fleet (runner.fleet) saw the runner that submitted these jobs end, whatever its
        exit code (a job that kills its own job-completed hook must not outlive its runner): cancel
        them with `reason`, destroying their VMs, end its sessions, revoke its jobs' tokens. Returns their ids."""
        ids = [run.record.id for run in self._active_runs() if run.spec.runner_name == runner_name]
        for job_id in ids:
            self.cancel(job_id, reason)
        self.sessions.end_where(lambda key: key.runner == runner_name, reason)
        self.access.end_runner_job(runner_name)
        return ids

    # -- internals --------------------------------------------------------------------------------

    def _create_vm(self, request: VMRequest) -> SandboxLike:
        sandbox = self._create(request)
        self.accel = sandbox.accel
        return sandbox

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
        run = self._run(job_id)
        if run is None:
            return
        try:
            if run.session is None:  # a kept VM outlives a pre-warmed VM's TTL: a session starts its own
                self._choose_template(run)
                self._claim_warm(run)
            elif not run.attached:
                self._choose_template(run)
            run.execute(self._create_vm, self.config)
        except Exception:  # execute never raises by design; a record that cannot be saved still might
            log.exception("job %s: the worker failed outside the job's own handling", job_id)
            self._abandon(run)
        finally:
            with self._lock:
                self._runs.pop(job_id, None)

    def _choose_template(self, run: JobRun) -> None:
        """The repository's warm base for its job, when it has one of the job's network variant."""
        template = self._template_for(run.spec.repository, _template_of(run.spec), run.policy)
        if template != run.spec.template:
            run.spec = dataclasses.replace(run.spec, template=template)
            run.log.system(f"restoring from the repository's warm base {template}")

    def _template_for(self, repository: str, template: str, policy: Policy | None) -> str:
        """The template a job of `repository` that names `template` restores from: the repository's warm
        base of the job's network variant when `template` is that base's parent (the default)."""
        if self.bases is None or template != self.bases.settings.parent:
            return template
        return self.bases.template_for(canonical_repository(repository), needs_network(policy))

    def _claim_warm(self, run: JobRun) -> None:
        spec = run.spec
        if spec.run_id is not None:
            key = RunKey(canonical_repository(spec.repository), spec.run_id, spec.run_attempt or 1)
            run.warm = self.warm.claim(key, _template_of(spec), run.record.policy_digest or "")
            if run.warm is not None:
                run.update(warm=True)

    def _abandon(self, run: JobRun) -> None:
        """Destroy whatever VM a job that failed outside `execute` holds, and end it, best effort."""
        for sandbox in {id(s): s for s in (run.warm, run.sandbox) if s is not None}.values():
            try:
                sandbox.destroy()
            except Exception:
                log.exception("job %s: destroying VM %s failed", run.record.id, sandbox.id)
        if run.session is not None:
            self.sessions.end(run.session, "the service failed to run a step of the job")
        try:
            _finish(run, JobState.FAILED, "the service failed to run this job; see the service log")
        except Exception:
            log.exception("job %s: its final record could not be saved", run.record.id)

    def _end(self, run: JobRun, state: JobState, reason: str) -> None:
        """Finish a job no worker holds (it never started); it leaves the service even if its record fails."""
        try:
            _finish(run, state, reason)
        finally:
            with self._lock:
                self._runs.pop(run.record.id, None)
            if run.session is not None:
                self.sessions.release(run.session)

    def _run(self, job_id: str) -> JobRun | None:
        with self._lock:
            return self._runs.get(job_id)

    def _need_run(self, job_id: str) -> JobRun:
        run = self._run(job_id)
        if run is None:
            self.get(job_id)
            raise JobStateConflict(f"job {job_id} has already ended")
        return run

    def _active_runs(self) -> builtins.list[JobRun]:
        with self._lock:
            return list(self._runs.values())

    def _reap(self) -> None:
        """The reaper thread: nothing one pass meets may stop the next, or nothing expires until a restart."""
        while not self._stopping.wait(_REAP_SECONDS):
            try:
                self.reap()
            except Exception:
                log.exception("the reaper's pass failed; it runs again in %g s", _REAP_SECONDS)

    def reap(self, now: float | None = None) -> None:
        """Expire unclaimed warm VMs and checkouts that never came; prune old records now and then.

        Each step and each job is handled on its own: one record that cannot be saved is logged and
        the rest are still expired.
        """
        now = time.time() if now is None else now
        _logged(self.warm.expire, "expiring pre-warmed VMs")
        _logged(self.sessions.expire, "expiring idle kept VMs")
        for run in self._active_runs():
            if run.record.state == JobState.AWAITING_CHECKOUT and now - run.record.created_at > self.config.checkout_wait_seconds:
                if self.queue.discard(run.record.id):
                    _logged(self._end, f"expiring job {run.record.id}", run, JobState.FAILED,
                            f"no checkout was uploaded within {self.config.checkout_wait_seconds:g} s")
        if now - self._last_prune > _PRUNE_SECONDS:
            _logged(self.prune, "pruning old records", now)

    def prune(self, now: float | None = None) -> builtins.list[str]:
        """Apply the retention settings to records and job directories."""
        now = time.time() if now is None else now
        self._last_prune = now
        retention = self.config.retention
        pruned = self.records.prune(now - retention.days * 86400, retention.max_records)
        for job_id in pruned:
            shutil.rmtree(self.config.jobs_dir / job_id, ignore_errors=True)
        return pruned

    def _sweep_job_dirs(self) -> None:
        """Remove job directories no record knows (a crash between mkdir and insert) and stale spools."""
        known = self.records.ids()
        for entry in self.config.jobs_dir.iterdir():
            if entry.name not in known or not entry.is_dir() or entry.is_symlink():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                continue
            for leftover in (CHECKOUT, f"{CHECKOUT}.part", "artifacts.raw", f"{ARTIFACTS}.part"):
                (entry / leftover).unlink(missing_ok=True)


def _finish(run: JobRun, state: JobState, reason: str) -> None:
    """`run.finish`, then the rest of what finishing means even if a save of its record failed, now or in
    an earlier `finish` (which then marked it final and stopped): the spooled checkout goes, log
    followers and cancel() waiters are released. Each step is idempotent."""
    try:
        run.finish(state, None, reason)
    finally:
        run.checkout_path.unlink(missing_ok=True)
        run.log.close()
        run.done.set()


def _queue_shares(config: ServiceConfig) -> dict[str, int]:
    """Each tenant kind's most queue slots: a repository half the queue (or the operator's number), a runner
    `max_queued_per_runner`."""
    return {"repository": config.max_queued_per_repository or max(1, config.max_queued_jobs // 2),
            "runner": config.max_queued_per_runner}


def _template_of(spec: JobSpec) -> str:
    """The template a validated spec names: `parse_spec` fills in the service's default."""
    assert spec.template is not None, f"job spec for {spec.repository} was not validated (no template)"
    return spec.template


def _logged(step: Callable[..., object], what: str, *args: object) -> None:
    """Run one step of a background pass; its failure is logged with a traceback and the pass goes on."""
    try:
        step(*args)
    except Exception:
        log.exception("%s failed", what)


def _destroy_vm(sandbox: SandboxLike) -> None:
    """A kept VM whose session ended; a failure is logged (the engine's TTL and sweep remain)."""
    try:
        sandbox.destroy()
    except Exception:
        log.exception("destroying kept VM %s failed", sandbox.id)


def _session_of_github_job(key: SessionKey, job: CompletedJob) -> bool:
    """Whether a session belongs to the GitHub job a `workflow_job` webhook speaks of (as `_same_github_job`)."""
    if (key.repository, key.run_id, key.run_attempt) != (canonical_repository(job.repository), job.run_id,
                                                         job.run_attempt):
        return False
    runner = job.runner_name
    if key.runner and runner:
        return key.runner == runner
    return key.job == job.job_name


def _same_github_job(spec: JobSpec, job: CompletedJob) -> bool:
    """Whether a submitted job is the GitHub job a webhook speaks of.

    The webhook names a job by its display name (`build (3.11)`), the action by its key in the
    workflow (`build`), so names only decide when the runner is unknown: a self-hosted runner runs
    one job at a time, so the run plus the runner's name identify the job exactly.
    """
    if ((canonical_repository(spec.repository), spec.run_id, spec.run_attempt or 1)
            != (canonical_repository(job.repository), job.run_id, job.run_attempt)):
        return False
    runner = job.runner_name
    if spec.runner_name and runner:
        return spec.runner_name == runner
    return spec.job_name == job.job_name


def _reported_is(bound: ReportedJob, job: CompletedJob) -> bool:
    """Whether the job a runner's hook reported is the run a `workflow_job completed` webhook speaks of."""
    return ((canonical_repository(bound.repository), bound.run_id, bound.run_attempt)
            == (canonical_repository(job.repository), job.run_id, job.run_attempt))
