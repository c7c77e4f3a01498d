"""The job a runner reports it got: its job-started hook sends it to the service with the runner's token.

The hook runs before any step of the job, as the trusted runner starts it, and the service binds the
runner to the first job it reports (runner/service/auth.py): the runner may then submit only for
that job. Every field is checked here before the service keeps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from runner.github.jobs import REPOSITORY_RE

MAX_TEXT = 256


@dataclass(frozen=True)
class ReportedJob:
    repository: str
    run_id: int
    run_attempt: int
    job: str
    workflow_ref: str
    event: str

    def describe(self) -> str:
        return f"{self.repository} run {self.run_id}/{self.run_attempt} job {self.job}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def from_environment(environ: Mapping[str, str]) -> ReportedJob:
    """What the runner tells every step about its job (GITHUB_* variables); ValueError if unusable."""
    job = parse({"repository": environ.get("GITHUB_REPOSITORY", ""), "run_id": _int(environ.get("GITHUB_RUN_ID")),
                 "run_attempt": _int(environ.get("GITHUB_RUN_ATTEMPT", "1")), "job": environ.get("GITHUB_JOB", ""),
                 "workflow_ref": environ.get("GITHUB_WORKFLOW_REF", ""), "event": environ.get("GITHUB_EVENT_NAME", "")})
    if job is None:
        raise ValueError("GITHUB_REPOSITORY, GITHUB_RUN_ID, GITHUB_RUN_ATTEMPT and GITHUB_JOB do not name a job")
    return job


def parse(data: object) -> ReportedJob | None:
    if not isinstance(data, dict):
        return None
    texts = [t for key in ("repository", "job", "workflow_ref", "event")
             if isinstance(t := data.get(key), str) and len(t) <= MAX_TEXT and t.isprintable()]
    numbers = [n for key in ("run_id", "run_attempt")
               if isinstance(n := data.get(key), int) and not isinstance(n, bool) and 0 < n < 2**63]
    if len(texts) != 4 or len(numbers) != 2:
        return None
    if not REPOSITORY_RE.match(texts[0]) or not texts[1]:
        return None
    return ReportedJob(texts[0], numbers[0], numbers[1], texts[1], texts[2], texts[3])


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isascii() and text.isdigit() and len(text) < 19 else None
