"""The runner desk: the runners whose tokens the service takes, the job each one is bound to, and
the fork guard those jobs pass through.

The fleet (runner.fleet) adds and removes its runners here; a runner's job-started hook binds it to
its job (what it may submit, once the guard's verdict, run here with the GitHub App the runner's
user must not reach, lets the job run); its job-completed hook, the runner's end and GitHub's
`completed` end what the job still runs. GitHub's `in_progress` says which run a registered runner
runs: only that run binds it on a service with a webhook (runner/service/jobs/auth.py). The guard's rules
and the App client are given by the host (runner/service/host/assembly.py), which reads them from disk and
the environment once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.fleet import report
from runner.jobapi.contract import GitHubJob, JobStarted, Verdict
from runner.service.jobs.admission import InvalidJob
from runner.service.jobs.auth import Access
from runner.service.jobs.service import JobService

if TYPE_CHECKING:
    from runner.github.client import GitHubClient
    from runner.github.guard import GuardRules

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardSetup:
    """What the fork guard runs with: the per-repository rules, the App's installation client (made only
    when a fork pull request needs GitHub), and why the rules could not be read (then it refuses every job)."""

    rules: GuardRules
    github: Callable[[], GitHubClient]
    problem: str | None = None


class RunnerDesk:
    def __init__(self, service: JobService, guard: GuardSetup) -> None:
        self.service = service
        self.access: Access = service.access
        self.guard = guard
        self._bound: list[Callable[[str, JobStarted], None]] = []

    def on_bound(self, listener: Callable[[str, JobStarted], None]) -> None:
        """Call `listener(runner, job)` whenever a runner's hook binds it to a job (the fleet marks it busy)."""
        self._bound.append(listener)

    def add_runner(self, name: str, token: str) -> None:
        """A fleet runner starts: its token (in its `.env`) lets it report and submit its one job."""
        self.access.runners.add(name, token)

    def remove_runner(self, name: str) -> None:
        """A fleet runner ended: its token opens nothing any more."""
        self.access.runners.remove(name)

    def runner_job(self, name: str) -> JobStarted | None:
        """The job the runner's hook reported (runner -> current job), for the fleet's status."""
        return self.access.runners.job_of(name)

    def runner_job_started(self, runner: str, started: JobStarted) -> Verdict:
        """A runner's job-started hook: bind the runner to its job (refused, 403, when it may not be:
        runner/service/jobs/auth.py), then run the fork guard here, with the App the runner user must not
        reach. Only a job the guard lets run may submit. Its verdict is what the hook prints."""
        reported = report.checked(started)
        if reported is None:
            raise InvalidJob("the reported job is not a job: repository, run_id, run_attempt and job are required")
        job = dataclasses.replace(reported, job=dataclasses.replace(reported.job, runner=runner))
        self.access.runners.bind(runner, job)
        log.info("runner %s took %s", runner, job.describe())
        for listener in self._bound:
            listener(runner, job)
        verdict = self._guard_verdict(started, job)
        if verdict.allowed:
            self.access.runners.allow(runner, job)
        else:
            log.warning("runner %s: the fork guard refused %s: %s", runner, job.describe(), " ".join(verdict.reasons))
        return verdict

    def _guard_verdict(self, started: JobStarted, job: JobStarted) -> Verdict:
        if self.guard.problem is not None:
            return Verdict(False, (f"the guard's rules could not be read ({self.guard.problem}), so it refuses the job.",))
        from runner.github import guard

        repository = job.job.repository
        guarded = started.guard.get("event_name") if isinstance(started.guard, dict) else None
        if guarded != started.event:  # what the service keeps (and trusts secrets: by) is what the guard checked
            return Verdict(False, ("the report's event and the event the guard is to check differ, so it refuses "
                                   "the job.",))
        verdict = guard.service_verdict(started.guard, repository, self.guard.rules.for_repository(repository),
                                        self.guard.github)
        return Verdict(verdict.allowed, verdict.reasons)

    def runner_placed(self, job: GitHubJob, job_id: int) -> None:
        """GitHub's `in_progress` of job `job_id`: `job` runs on its runner (`job.runner`). For a registered
        runner that is what its hook's report must name; a binding it still held of another run has
        ended, and ends here as GitHub's `completed` would end it."""
        stale = self.access.runners.place(job.runner, job, job_id)
        if stale is not None:
            self.github_job_completed(stale.job, f"GitHub reports runner {job.runner} running another job "
                                                 f"({job.describe()})")
            self.access.jobs.forget_runner(job.runner)  # the binding is gone already: its jobs' tokens go too

    def github_job_completed(self, completed: GitHubJob, why: str, job_id: int | None = None) -> None:
        """GitHub says `completed` ended (its `completed` delivery of job `job_id`, or its runner's next
        `in_progress`): whatever still runs for it is cancelled, its kept VMs end, and its runner's
        binding with its token (a fleet runner's) and its jobs' tokens end; a registered runner waits for
        its next job."""
        service = self.service
        for run in service.runs.all():
            if run.spec.github is not None and run.spec.github.named_by(completed):
                service.cancel(run.record.id, why)
        service.sessions.end_where(lambda key: key.named_by(completed), why)
        if not completed.runner:
            return
        if job_id is not None:
            self.access.runners.unplace(completed.runner, job_id)
        bound = self.access.runners.job_of(completed.runner)
        if bound is not None and bound.job.same_run(completed):
            self.access.end_runner_job(completed.runner)  # its token submits nothing after `completed`

    def runner_job_completed(self, runner: str) -> list[str]:
        """A runner's job-completed hook: whatever its job still runs is cancelled and its VM destroyed."""
        self.access.end_runner_job(runner, by_hook=True)  # first: nothing is admitted while its jobs end
        return self._end_jobs_of(runner, f"the GitHub job ended (runner {runner}'s job-completed hook) while this "
                                         "job still ran", f"runner {runner}'s job-completed hook")

    def runner_died(self, runner_name: str, reason: str) -> list[str]:
        """The runner fleet (runner.fleet) saw the runner that submitted these jobs end, whatever its
        exit code (a job that kills its own job-completed hook must not outlive its runner): cancel
        them with `reason`, destroying their VMs, end its sessions, revoke its jobs' tokens. Returns their ids."""
        # Its tokens first: ending its jobs waits for their VMs to go, and a submit with its token meanwhile
        # was still admitted (a job seen ended while its runner's token still worked).
        self.access.end_runner_job(runner_name)
        return self._end_jobs_of(runner_name, reason, reason)

    def _end_jobs_of(self, runner: str, reason: str, session_reason: str) -> list[str]:
        ids = self.service.runs.of_runner(runner)
        for job_id in ids:
            self.service.cancel(job_id, reason)
        self.service.sessions.end_where(lambda key: key.runner == runner, session_reason)
        return ids
