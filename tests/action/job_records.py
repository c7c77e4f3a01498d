"""Job records for the action's summary and report tests, written as the wire's JSON fields (docs/job-api.md).

The action reports the typed record its client read (`JobRecord`); these tests give only the fields each
is about. Nothing is validated but what a client validates too: the blocked-egress and artifact entries
are read by their `from_wire`, so a test's hostile entry reaches the summary as the action would see it,
and a field of the wrong type (an exit code "0") stays as given, for the step's exit status to judge.
"""

from __future__ import annotations

from typing import Any

from microvm_check.entries import Artifact, AuditRecord
from runner.jobapi.contract import JobRecord, Timings

DEFAULTS: dict[str, Any] = {"id": "j1", "state": "finished", "repository": "o/r", "sha": "a" * 40, "run_id": None,
                            "run_attempt": None, "job_name": "t"}


def job_record(fields: dict[str, Any]) -> JobRecord:
    """A record of `fields` over DEFAULTS; unknown keys are an error, as a typo in a test should be."""
    given = {**DEFAULTS, **fields}
    given["timings"] = Timings.from_wire(given.get("timings"))
    given["blocked_egress"] = [e for e in map(AuditRecord.from_wire, given.get("blocked_egress", [])) if e]
    given["artifacts"] = [e for e in map(Artifact.from_wire, given.get("artifacts", [])) if e]
    return JobRecord(**given)
