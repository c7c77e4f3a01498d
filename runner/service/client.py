"""Transitional: the job API client with the old dict answers, for tests still being written against it.

The client is runner.jobapi.client.JobClient, whose answers are the contract's types. This subclass
turns them back into their wire form (dicts) for the callers that still index them; it goes once
tests/service/test_vm_e2e_network.py, tests/service/test_vm_e2e_serve.py and
tests/action/test_action_vm_e2e.py (in progress in parallel) use runner.jobapi directly.
"""

from __future__ import annotations

from typing import Any

from runner.jobapi import client as _typed
from runner.jobapi.client import JobAPIError
from runner.jobapi.contract import DEFAULT_SOCKET, LogEntry

__all__ = ["DEFAULT_SOCKET", "JobAPIError", "JobClient", "LogEntry"]


class JobClient(_typed.JobClient):
    def health(self) -> Any:
        return super().health().to_wire()

    def submit(self, spec: Any) -> Any:
        return super().submit(spec).to_wire()

    def upload_checkout(self, job_id: str, data: Any) -> Any:
        return super().upload_checkout(job_id, data).to_wire()

    def get(self, job_id: str) -> Any:
        return super().get(job_id).to_wire()

    def list(self, limit: int = 50) -> Any:
        return [record.to_wire() for record in super().list(limit)]

    def cancel(self, job_id: str) -> Any:
        return super().cancel(job_id).to_wire()
