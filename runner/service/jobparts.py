"""The job service's parts, made once by the host (runner/service/host_jobs.py) and given to JobService
(runner/service/service.py): the records, the queue with each tenant's share, the pre-warmed VMs, the
`keep: job` sessions, the in-memory jobs, admission and the workers, on the VMs, policies, access rules,
signer and check-run reporter the host made from disk and the environment. The other roles (the runner
desk, the GitHub reactions, retention, the API) reach the parts through the service."""

from __future__ import annotations

from dataclasses import dataclass

from runner.fleet import registered
from runner.fleet.registered import Credential
from runner.service.admission import Admission
from runner.service.attestation import JobAttestor
from runner.service.auth import Access
from runner.service.checkruns import CheckRunReporter
from runner.service.config import ServiceConfig
from runner.service.egress import EgressPolicies
from runner.service.jobqueue import JobQueue
from runner.service.prewarm import PrewarmedVMs
from runner.service.records import RecordStore
from runner.service.runs import ActiveRuns
from runner.service.sessions import Sessions, destroy_kept
from runner.service.workers import JobVMs, Workers


@dataclass(frozen=True)
class JobParts:
    policies: EgressPolicies
    records: RecordStore
    attestor: JobAttestor
    check_runs: CheckRunReporter | None
    queue: JobQueue
    prewarmed: PrewarmedVMs
    sessions: Sessions
    access: Access
    admission: Admission
    runs: ActiveRuns
    vms: JobVMs
    workers: Workers


def job_parts(config: ServiceConfig, vms: JobVMs, *, attestor: JobAttestor, policies: EgressPolicies | None = None,
              access: Access | None = None, check_runs: CheckRunReporter | None = None) -> JobParts:
    """`vms` makes a job's VM from its `VMRequest` (runner/service/workers.py): the host's engine as a
    `SandboxProvider`, or a stand-in in tests, with the repositories' warm bases on that engine."""
    policies = policies or EgressPolicies(config.policy_dir)
    config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # job logs and artifacts: not for other users
    config.jobs_dir.mkdir(exist_ok=True, mode=0o700)
    queue = JobQueue(config.max_queued_jobs, max_queued=_queue_shares(config), max_running={
        "repository": config.max_running_per_repository or config.max_concurrent_jobs})
    prewarmed = PrewarmedVMs(config.prewarm.max_vms, config.prewarm.expire_seconds)
    sessions = Sessions(destroy_kept)  # `keep: job`: one VM across a GitHub job's steps
    records = RecordStore(config.records_path, kept=sessions.holds)  # a kept VM's step says "kept"
    access = access or access_for(config)
    runs = ActiveRuns()
    return JobParts(policies, records, attestor, check_runs, queue, prewarmed, sessions, access,
                    Admission(config, access, policies, sessions), runs, vms,
                    Workers(config, queue, runs, vms, prewarmed, sessions))


def access_for(config: ServiceConfig, registered: dict[str, Credential] | None = None) -> Access:
    """Who may do what on this service (runner/service/auth.py); `registered`: the runner credentials
    `microvm-check register --service-config` left in the state directory (the host reads them)."""
    return Access(config.admin_group, fleet=config.runners.org is not None,
                  local_repository=config.local_jobs.repository, registered=registered,
                  binding_seconds=config.runners.job_timeout_seconds + config.runners.deadline_grace_seconds,
                  placed_by_webhook=_placed_by_webhook(config))


def _placed_by_webhook(config: ServiceConfig) -> bool:
    """Whether GitHub's `in_progress` deliveries say which job a registered runner runs: the one authority
    on it a job cannot speak for (without it, the operator holds each runner to one repository)."""
    return config.webhook.listen is not None


def runner_binding(config: ServiceConfig) -> list[str]:
    """Which job a runner's submits are bound to on this host, and what that allows: for `config check`
    and `doctor`, from the same settings `access_for` reads."""
    lines = []
    if config.runners.org is not None:
        lines.append("fleet runners: each is bound to the one job its hook reports before any step, and its "
                     "token ends with that job")
    if _placed_by_webhook(config):
        lines.append("registered runners (`runner credential`): webhook mode: bound only to the run GitHub's signed "
                     "workflow_job in_progress delivery puts on the runner (its name on GitHub = its credential's "
                     "name; webhook.labels must cover its jobs), and to its credential's repository when one is "
                     "named; a job's own report or job-completed call cannot rebind it")
    else:
        lines.append("registered runners (`runner credential`): repository mode (no webhook): each is held to the "
                     "repository its credential names (`runner credential --repository OWNER/NAME`); one whose "
                     "credential names none takes no job")
    lines.extend(_registered_runners(config))
    local = config.local_jobs.repository
    members = ("health only (a fleet host)" if config.runners.org is not None else
               f"local jobs, run as {local} under its policy" if local is not None else
               "may not submit (local_jobs.repository is unset)")
    lines.append(f"socket members without a credential: {members}")
    return [f"runner binding: {line}" for line in lines]


def _registered_runners(config: ServiceConfig) -> list[str]:
    """What each registered runner's credential in the state directory lets it take, in this mode."""
    try:
        credentials = registered.load(config.state_dir)
    except OSError as exc:
        return [f"registered runners' credentials in {config.state_dir}: not readable here ({exc.strerror}); "
                "run as root to list them"]
    webhook = _placed_by_webhook(config)
    lines = []
    for name, credential in sorted(credentials.items()):
        if credential.repository is not None:
            takes = f"jobs of {credential.repository} only" + (", as GitHub places them" if webhook else "")
        else:
            takes = "the jobs GitHub places on it" if webhook else "no job (its credential names no repository)"
        lines.append(f"registered runner {name}: takes {takes}")
    return lines


def _queue_shares(config: ServiceConfig) -> dict[str, int]:
    """Each tenant kind's most queue slots: a repository half the queue (or the operator's number), a runner
    `max_queued_per_runner`."""
    return {"repository": config.max_queued_per_repository or max(1, config.max_queued_jobs // 2),
            "runner": config.max_queued_per_runner}
