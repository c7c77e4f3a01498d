"""Submitting a job and reading its output, for the real-VM service tests that run it through the API.

They use the typed client of the job API's contract (runner.jobapi), as the action does.
"""

from __future__ import annotations

from typing import Any

from service_fakes import checkout_tar, spec

from runner.jobapi.client import JobClient


def submit(client: JobClient, command: str, files: dict[str, bytes] | None = None, **fields: Any) -> str:
    """Submit `command` with a checkout of `files` (default: a README); the job's id."""
    job = client.submit(spec(command, **fields)).id
    client.upload_checkout(job, checkout_tar(files))
    return job


def output(client: JobClient, job: str) -> bytes:
    """The job's stdout and stderr, once its log has ended (so once the job has)."""
    return b"".join(e.data for e in client.logs(job) if e.stream in ("stdout", "stderr"))
