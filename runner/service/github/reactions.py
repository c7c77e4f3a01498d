"""What the service does when GitHub speaks (the webhook's `JobHooks`, runner.github.jobs): a queued
job gets a VM restored ahead of its submit, one in progress binds a registered runner (the runner
desk), a completed one loses whatever still runs or waits for it, and a push to a repository's
default branch rebuilds its warm bases.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from runner.jobapi.contract import GitHubJob, canonical_repository
from runner.sandbox.port import needs_network
from runner.service.github.desk import RunnerDesk
from runner.service.jobs.egress import EgressPolicyError
from runner.service.jobs.job import vm_request
from runner.service.jobs.service import JobService
from runner.service.jobs.templatechoice import choose_template

if TYPE_CHECKING:
    from runner.github.jobs import CompletedJob, InProgressJob, Push, QueuedJob, WorkflowJob

log = logging.getLogger(__name__)


class GitHubReactions:
    def __init__(self, service: JobService, desk: RunnerDesk) -> None:
        self.service = service
        self.desk = desk

    def prewarm(self, job: QueuedJob) -> None:
        """Restore a VM for a queued GitHub job ahead of its submit (best effort, bounded), from the
        template its submit will restore from (`choose_template`, in the background: it may ask GitHub)."""
        service, config = self.service, self.service.config
        if service.stopping:
            return
        try:
            policy = service.policies.effective(job.repository, None)
        except EgressPolicyError as exc:  # the policy's own message says what to fix; the stack only at DEBUG
            log.warning("not pre-warming for %s: its policy does not load: %s", job.repository, exc)
            log.debug("not pre-warming for %s", job.repository, exc_info=True)
            return
        if needs_network(policy) and not config.network.enabled:
            return  # its submit will be refused: see Admission.admit
        vms = service.vms
        service.prewarmed.prewarm(_announced(job), job.job_id, policy.digest(),
                                  lambda: choose_template(config.default_template, repository=job.repository,
                                                          policy=policy, bases=vms.bases),
                                  lambda choice: vms.create(vm_request(
            config, choice, ttl_seconds=int(config.prewarm.expire_seconds) + config.max_timeout_seconds,
            policy=policy, job_id=f"warm-{job.job_id}")))

    def job_in_progress(self, job: InProgressJob) -> None:
        """GitHub says the job runs on its runner: what a registered runner's report may bind it to."""
        self.desk.runner_placed(_announced(job, job.runner_name), job.job_id)

    def job_completed(self, job: CompletedJob) -> None:
        """GitHub says the job ended: whatever still runs or waits for it is cancelled and its VM destroyed."""
        completed = _announced(job, job.runner_name)
        self.service.prewarmed.discard_job(completed, job.job_id)
        why = f"GitHub reports the job completed ({job.conclusion or 'no conclusion'})"
        self.desk.github_job_completed(completed, why, job.job_id)

    def default_branch_pushed(self, push: Push) -> None:
        """GitHub says the repository's default branch moved: its warm bases are stale, rebuild them
        from the pushed commit (in the background; jobs keep the last good base meanwhile)."""
        bases = self.service.vms.bases
        if bases is None or self.service.stopping:
            return
        rebuilt = bases.pushed(canonical_repository(push.repository), push.after)
        if rebuilt:
            log.info("push to %s's default branch (%s): rebuilding its warm bases", push.repository, push.after[:12])


def _announced(job: WorkflowJob, runner: str | None = None) -> GitHubJob:
    """The job a `workflow_job` webhook speaks of: named by its display name, on its runner if it has one."""
    return GitHubJob(job.repository, job.run_id, job.run_attempt, job.job_name, runner or "")
