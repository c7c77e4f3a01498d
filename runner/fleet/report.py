"""The job a runner reports it got: its job-started hook sends it to the service with the runner's token.

The hook runs before any step of the job, as the trusted runner starts it, and the service binds the
runner to the first job it reports (runner/service/jobs/auth.py): the runner may then submit only for
that job. The report is the job API's `JobStarted` (runner/jobapi/contract.py), checked here before
the service keeps it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from runner.github.jobs import REPOSITORY_RE
from runner.jobapi.contract import GitHubJob, JobStarted

MAX_TEXT = 256


def from_environment(environ: Mapping[str, str]) -> JobStarted:
    """What the runner tells every step about its job (GITHUB_* variables); ValueError if unusable."""
    run_id, run_attempt = _int(environ.get("GITHUB_RUN_ID")), _int(environ.get("GITHUB_RUN_ATTEMPT", "1"))
    started = None
    if run_id is not None and run_attempt is not None:
        started = checked(JobStarted(GitHubJob(environ.get("GITHUB_REPOSITORY", ""), run_id, run_attempt,
                                               environ.get("GITHUB_JOB", "")),
                                     environ.get("GITHUB_WORKFLOW_REF", ""), environ.get("GITHUB_EVENT_NAME", "")))
    if started is None:
        raise ValueError("GITHUB_REPOSITORY, GITHUB_RUN_ID, GITHUB_RUN_ATTEMPT and GITHUB_JOB do not name a job")
    return started


def checked(started: JobStarted) -> JobStarted | None:
    """The report as the service keeps it (no guard context: that is for the guard alone), or None when
    it names no job: an owner/name repository, a job name, printable texts of at most MAX_TEXT
    characters and run numbers from 1 to 2**63 - 1."""
    job = started.job
    texts = (job.repository, job.job, started.workflow_ref, started.event)
    if not all(isinstance(t, str) and len(t) <= MAX_TEXT and t.isprintable() for t in texts):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 2**63 for n in (job.run_id, job.run_attempt)):
        return None
    if not REPOSITORY_RE.match(job.repository) or not job.job:
        return None
    return dataclasses.replace(started, guard=None)


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isascii() and text.isdigit() and len(text) < 19 else None
