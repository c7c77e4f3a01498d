"""What the service does when GitHub speaks (the webhook's `JobHooks`, runner.github.jobs): a queued
job gets a VM restored ahead of its submit, a completed one loses whatever still runs or waits for
it, and a push to a repository's default branch rebuilds its warm bases.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from runner.fleet.report import ReportedJob
from runner.jobapi.contract import JobSpec, canonical_repository
from runner.sandbox.port import needs_network
from runner.service.desk import RunnerDesk
from runner.service.egress import EgressPolicyError
from runner.service.job import vm_request
from runner.service.prewarm import RunKey
from runner.service.service import JobService
from runner.service.sessions import SessionKey

if TYPE_CHECKING:
    from runner.github.jobs import CompletedJob, Push, QueuedJob

log = logging.getLogger(__name__)


class GitHubReactions:
    def __init__(self, service: JobService, desk: RunnerDesk) -> None:
        self.service = service
        self.desk = desk

    def prewarm(self, job: QueuedJob) -> None:
        """Restore a VM for a queued GitHub job ahead of its submit (best effort, bounded), from the
        template its submit will restore from: the repository's warm base, chosen in the background."""
        service, config = self.service, self.service.config
        if service.stopping:
            return
        template = config.default_template
        try:
            policy = service.policies.effective(job.repository, None)
        except EgressPolicyError as exc:  # the policy's own message says what to fix; the stack only at DEBUG
            log.warning("not pre-warming for %s: its policy does not load: %s", job.repository, exc)
            log.debug("not pre-warming for %s", job.repository, exc_info=True)
            return
        if needs_network(policy) and not config.network.enabled:
            return  # its submit will be refused: see JobService._admit
        key = RunKey(canonical_repository(job.repository), job.run_id, job.run_attempt)
        vms = service.vms
        service.prewarmed.prewarm(key, job.job_id, policy.digest(),
                             lambda: vms.template_for(job.repository, template, policy),
                             lambda chosen: vms.create(vm_request(
            config, template=chosen, ttl_seconds=int(config.prewarm.expire_seconds) + config.max_timeout_seconds,
            policy=policy, job_id=f"warm-{job.job_id}")))

    def job_completed(self, job: CompletedJob) -> None:
        """GitHub says the job ended: whatever still runs or waits for it is cancelled and its VM destroyed."""
        service = self.service
        key = RunKey(canonical_repository(job.repository), job.run_id, job.run_attempt)
        service.prewarmed.discard_job(key, job.job_id)
        why = f"GitHub reports the job completed ({job.conclusion or 'no conclusion'})"
        for run in service.runs.all():
            if _same_github_job(run.spec, job):
                service.cancel(run.record.id, why)
        service.sessions.end_where(lambda session: _session_of_github_job(session, job), why)
        bound = self.desk.runner_job(job.runner_name) if job.runner_name else None
        if bound is not None and job.runner_name and _reported_is(bound, job):
            service.access.end_runner_job(job.runner_name)  # its token submits nothing after `completed`

    def default_branch_pushed(self, push: Push) -> None:
        """GitHub says the repository's default branch moved: its warm bases are stale, rebuild them
        from the pushed commit (in the background; jobs keep the last good base meanwhile)."""
        bases = self.service.vms.bases
        if bases is None or self.service.stopping:
            return
        rebuilt = bases.pushed(canonical_repository(push.repository), push.after)
        if rebuilt:
            log.info("push to %s's default branch (%s): rebuilding its warm bases", push.repository, push.after[:12])


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
