"""The job a runner reports it got, as its job-started hook wrote it.

The hook runs as the runner user, and later steps of the same job run as that user too, so the
report is the runner's word, not proof: it is read bounded, without following links, and checked
field by field. It only says which job a busy runner has (status, and the job the service cancels
when the runner dies); nothing grants access by it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from runner.github.jobs import REPOSITORY_RE

MAX_REPORT = 4096
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


def write(path: Path, job: ReportedJob) -> None:
    """Create the report; never through an existing file or link (one report per runner)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(job.to_json(), out)


def read(path: Path) -> ReportedJob | None:
    """The report if there is a usable one; None when absent, a link, too large or malformed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_REPORT + 1)
    if len(data) > MAX_REPORT:
        return None
    try:
        return parse(json.loads(data))
    except (ValueError, UnicodeDecodeError):
        return None


def parse(data: Any) -> ReportedJob | None:
    if not isinstance(data, dict):
        return None
    texts = [data.get(key) for key in ("repository", "job", "workflow_ref", "event")]
    numbers = [data.get(key) for key in ("run_id", "run_attempt")]
    if not all(isinstance(t, str) and len(t) <= MAX_TEXT and t.isprintable() for t in texts):
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 2**63 for n in numbers):
        return None
    if not REPOSITORY_RE.match(texts[0]) or not texts[1]:
        return None
    return ReportedJob(texts[0], numbers[0], numbers[1], texts[1], texts[2], texts[3])


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isascii() and text.isdigit() and len(text) < 19 else None
