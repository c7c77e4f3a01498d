"""The job service's parts, made once by the host (runner/service/host/jobs.py) and given to JobService
(runner/service/jobs/service.py): the records, the queue with each tenant's share, the pre-warmed VMs, the
`keep: job` sessions, the in-memory jobs, admission and the workers, on the VMs, policies, access rules,
signer and check-run reporter the host made from disk and the environment. The other roles (the runner
desk, the GitHub reactions, retention, the API) reach the parts through the service."""

from __future__ import annotations

from dataclasses import dataclass

from runner.service.config.settings import ServiceConfig
from runner.service.jobs.admission import Admission
from runner.service.jobs.attestation import JobAttestor
from runner.service.jobs.auth import Access
from runner.service.jobs.egress import EgressPolicies
from runner.service.jobs.job import JobWatcher
from runner.service.jobs.jobqueue import JobQueue
from runner.service.jobs.prewarm import PrewarmedVMs
from runner.service.jobs.records import RecordStore
from runner.service.jobs.runs import ActiveRuns
from runner.service.jobs.sessions import Sessions, destroy_kept
from runner.service.jobs.workers import JobVMs, Workers


@dataclass(frozen=True)
class JobParts:
    policies: EgressPolicies
    records: RecordStore
    attestor: JobAttestor
    check_runs: JobWatcher | None
    queue: JobQueue
    prewarmed: PrewarmedVMs
    sessions: Sessions
    access: Access
    admission: Admission
    runs: ActiveRuns
    vms: JobVMs
    workers: Workers


def job_parts(config: ServiceConfig, vms: JobVMs, *, attestor: JobAttestor, access: Access,
              policies: EgressPolicies | None = None, check_runs: JobWatcher | None = None) -> JobParts:
    """`vms` makes a job's VM from its `VMRequest` (runner/service/jobs/workers.py): the host's engine as a
    `SandboxProvider`, or a stand-in in tests, with the repositories' warm bases on that engine; `access`
    is who may do what (runner/service/host/binding.py `access_for`, with the registered runners the host read)."""
    policies = policies or EgressPolicies(config.policy_dir)
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # job logs and artifacts: not for other users
    config.jobs_dir.mkdir(exist_ok=True, mode=0o700)
    queue = JobQueue(config.max_queued_jobs, max_queued=_queue_shares(config), max_running={
        "repository": config.max_running_per_repository or config.max_concurrent_jobs})
    prewarmed = PrewarmedVMs(config.prewarm.max_vms, config.prewarm.expire_seconds)
    sessions = Sessions(destroy_kept)  # `keep: job`: one VM across a GitHub job's steps
    records = RecordStore(config.records_path, kept=sessions.holds)  # a kept VM's step says "kept"
    runs = ActiveRuns()
    return JobParts(policies, records, attestor, check_runs, queue, prewarmed, sessions, access,
                    Admission(config, access, policies, sessions), runs, vms,
                    Workers(config, queue, runs, vms, prewarmed, sessions, policies))


def _queue_shares(config: ServiceConfig) -> dict[str, int]:
    """Each tenant kind's most queue slots: a repository half the queue (or the operator's number), a runner
    `max_queued_per_runner`."""
    return {"repository": config.max_queued_per_repository or max(1, config.max_queued_jobs // 2),
            "runner": config.max_queued_per_runner}
