"""The job's `keep: job` session token on the runner host, where only the job's later steps find it.

The service answers the step that opens a session (`keep: job`) with the session's token; a later
step of the same GitHub job attaches to the kept VM only by sending it back (runner/service/jobs/sessions.py).
It is kept in a 0600 file in RUNNER_TEMP: the runner gives each job a fresh one and empties it after
the job, so the token lives exactly as long as the job, and no other job (another run, another
runner, a run with the same ids) has it. It never enters the guest: only the checkout (the workspace)
and the `env` input's variables go there, and RUNNER_TEMP is neither.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from runner.jobapi.contract import MAX_TOKEN, JobSummary

FILE = "microvm-check-session"


def path(environ: Mapping[str, str]) -> Path | None:
    temp = environ.get("RUNNER_TEMP")
    return Path(temp) / FILE if temp else None


def read(environ: Mapping[str, str]) -> str | None:
    """The token an earlier step of this job kept, or None (no session, or nowhere to keep one)."""
    where = path(environ)
    if where is None:
        return None
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        text = file.read(MAX_TOKEN + 1).decode("ascii", "replace").strip()
    return text if text and len(text) <= MAX_TOKEN else None


def after_submit(environ: Mapping[str, str], keep: str, summary: JobSummary) -> str | None:
    """Keep the token of a session this step opened; forget it when this step ends the session
    (`keep: none`). Returns a warning for the log, or None."""
    where = path(environ)
    if where is None:
        return ("RUNNER_TEMP is not set, so the kept VM's token cannot be kept for this job's next step: "
                "later steps get VMs of their own") if summary.session_token else None
    if summary.session_token:
        _write(where, summary.session_token)
    elif keep != "job":
        where.unlink(missing_ok=True)
    return None


def _write(where: Path, token: str) -> None:
    """0600 from the start (never another mode, not even for an instant), replaced in one step."""
    temporary = where.with_name(f".{where.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")
    os.replace(temporary, where)
