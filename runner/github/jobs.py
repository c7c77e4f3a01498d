"""What the webhook tells the job service: a job for our labels is queued, runs on a runner (in
progress), or has completed, or a repository's default branch moved (a `push`: its warm bases are stale).

Payloads come from the network and vary with their age (old deliveries lack `run_attempt`, new ones
carry fields we have never seen), so parsing reads only the fields we need, checks their types, and
answers None rather than raising for anything it cannot use.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

SELF_HOSTED = "self-hosted"
# Owners are letters, digits, '-' (and '_' for managed users); repository names may hold dots but
# are never "." or "..": the name ends up in API paths and directory names, so it must not traverse.
REPOSITORY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}/(?!\.{1,2}\Z)[A-Za-z0-9_.-]{1,100}\Z")
MAX_NAME = 1024
MAX_LABELS = 100
MAX_ID = 2**63 - 1  # GitHub's ids are 64-bit; the job service stores run ids in SQLite's signed integers
COMMIT_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})\Z")  # SHA-1, or SHA-256 repositories
MAX_REF = 255  # git refuses longer ref components; a branch ref longer than this is not one we act on


@dataclass(frozen=True)
class WorkflowJob:
    """What every `workflow_job` delivery says of its job, whatever its action (`_job_fields` reads it):
    declared once so the queued, in-progress and completed jobs cannot drift apart. The webhook hands on
    only the subclasses; each is still equal only to its own kind (dataclass equality compares classes)."""

    repository: str
    run_id: int
    run_attempt: int
    job_id: int
    job_name: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class QueuedJob(WorkflowJob):
    """A job waiting for a runner with our labels: what a VM is warmed for."""


@dataclass(frozen=True)
class CompletedJob(WorkflowJob):
    conclusion: str | None
    runner_name: str | None


@dataclass(frozen=True)
class InProgressJob(WorkflowJob):
    """A job a runner took: GitHub's word on which runner runs it (what binds a registered runner)."""

    runner_name: str


@dataclass(frozen=True)
class Push:
    """A push to a repository's default branch: `after` is the commit the branch now points at."""

    repository: str
    after: str


class JobHooks(Protocol):
    """Implemented by the job service: warm a VM for a queued job; note the runner a job runs on;
    release whatever a completed (or cancelled) job left, including a pre-warmed VM nobody claimed;
    rebuild a repository's warm bases when its default branch moved.

    All are called on the webhook's request thread and must return quickly (GitHub gives up on a
    delivery after 10 s): queue the work, do not do it. An exception makes the delivery fail with
    500 and leaves it to the redelivery sweep.
    """

    def prewarm(self, job: QueuedJob) -> None: ...

    def job_in_progress(self, job: InProgressJob) -> None: ...

    def job_completed(self, job: CompletedJob) -> None: ...

    def default_branch_pushed(self, push: Push) -> None: ...


def is_ours(job_labels: Iterable[str], our_labels: Iterable[str]) -> bool:
    """True when every label the job asks for is one of ours (or `self-hosted`), case-insensitively
    as GitHub matches them: exactly the jobs GitHub may hand to our runner. A job asking for any
    other label would go elsewhere, and warming a VM for it would waste one."""
    ours = {label.lower() for label in our_labels} | {SELF_HOSTED}
    wanted = {label.lower() for label in job_labels}
    return bool(wanted) and wanted <= ours


def queued_job(payload: Mapping[str, Any]) -> QueuedJob | None:
    fields = _job_fields(payload)
    return QueuedJob(**fields) if fields else None


def completed_job(payload: Mapping[str, Any]) -> CompletedJob | None:
    fields = _job_fields(payload)
    if not fields:
        return None
    job = payload["workflow_job"]
    return CompletedJob(
        **fields,
        conclusion=_short_str(job.get("conclusion")),
        runner_name=_short_str(job.get("runner_name")),
    )


def in_progress_job(payload: Mapping[str, Any]) -> InProgressJob | None:
    """The job and the runner that runs it; None without a runner's name (nothing to bind)."""
    fields = _job_fields(payload)
    runner_name = _short_str(payload["workflow_job"].get("runner_name")) if fields else None
    return InProgressJob(**fields, runner_name=runner_name) if fields and runner_name else None


def default_branch_push(payload: Mapping[str, Any]) -> Push | None:
    """The push when it moved the repository's default branch to a commit; None for anything else
    (another branch, a tag, the branch deleted) or anything malformed. Reads only the fields GitHub
    documents for every push delivery: `ref`, `after`, `repository.full_name` and
    `repository.default_branch`."""
    repo = payload.get("repository")
    if not isinstance(repo, dict):
        return None
    repository, branch = repo.get("full_name"), repo.get("default_branch")
    ref, after = payload.get("ref"), payload.get("after")
    if not (isinstance(repository, str) and REPOSITORY_RE.match(repository)):
        return None
    if not (_short_str(branch) and isinstance(ref, str) and len(ref) <= MAX_REF and ref == f"refs/heads/{branch}"):
        return None
    if not (isinstance(after, str) and COMMIT_RE.match(after)) or not after.strip("0"):
        return None  # the all-zero sha: the branch was deleted, there is nothing to build from
    return Push(repository, after)


def _job_fields(payload: Mapping[str, Any]) -> dict[str, Any] | None:
    job = payload.get("workflow_job")
    repo = payload.get("repository")
    if not isinstance(job, dict) or not isinstance(repo, dict):
        return None
    repository = repo.get("full_name")
    labels = job.get("labels")
    run_attempt = job.get("run_attempt", 1)  # absent from pre-2022 deliveries; attempts start at 1
    ids = (job.get("run_id"), run_attempt, job.get("id"))
    if not (isinstance(repository, str) and REPOSITORY_RE.match(repository)):
        return None
    if not all(_positive_int(value) for value in ids):
        return None
    if not isinstance(labels, list) or len(labels) > MAX_LABELS or not all(_short_str(x) for x in labels):
        return None
    return {
        "repository": repository,
        "run_id": job["run_id"],
        "run_attempt": run_attempt,
        "job_id": job["id"],
        "job_name": _short_str(job.get("name")) or "",
        "labels": tuple(labels),
    }


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_ID


def _short_str(value: Any) -> str | None:
    """A name fit to log, store and compare: bounded, valid Unicode (JSON can carry lone surrogates such
    as "\\ud800", which SQLite and every encoder refuse) and free of control characters: `isprintable()`
    is False for both."""
    if isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable():
        return value
    return None
