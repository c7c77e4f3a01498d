"""The job API's contract: one source for what client and service agree on, states that move only forward."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from microvm_check.entries import Artifact, AuditRecord
from runner.jobapi import contract
from runner.jobapi.contract import (
    FINAL_STATES,
    JobRecord,
    JobSpec,
    JobState,
    LogEntry,
    StateTransitionError,
    Timings,
    WireError,
)
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.job import AdmittedSpec
from tests.service.service_fakes import spec_as_sent

ROOT = Path(__file__).resolve().parents[2]


def record(state: JobState = JobState.AWAITING_CHECKOUT) -> JobRecord:
    return JobRecord(id="j0123456789abcdef", state=state, repository="octo/repo", sha="a" * 40, run_id=7,
                     run_attempt=1, job_name="check", created_at=1.5, policy_digest="sha256:x",
                     timings=Timings(queued_at=2.0, vm_ready_ms=3.25),
                     blocked_egress=[AuditRecord("1.2.3.4", 443, "tcp", None, 1, "policy")],
                     artifacts=[Artifact("report.xml", 12)])


def test_a_job_moves_through_its_states_in_order():
    rec = record()
    for state in ("queued", "starting", "running", "finished"):
        rec.state = state
        assert rec.state is JobState(state)
    assert rec.final


@pytest.mark.parametrize("final", FINAL_STATES)
def test_a_final_state_never_changes(final: JobState):
    rec = record(JobState.RUNNING)
    rec.state = final
    for other in JobState:
        if other != final:
            with pytest.raises(StateTransitionError, match=f"job j0123456789abcdef: {final} cannot become {other}"):
                rec.state = other
    assert rec.state is final


@pytest.mark.parametrize("old,new", [("awaiting_checkout", "running"), ("awaiting_checkout", "finished"),
                                     ("queued", "running"), ("starting", "finished"), ("starting", "timed_out")])
def test_states_cannot_skip_what_makes_them_true(old: str, new: str):
    rec = record(JobState(old))
    with pytest.raises(StateTransitionError, match=f"{old} cannot become {new}"):
        rec.state = new


def test_an_unknown_state_is_refused():
    with pytest.raises(ValueError, match="'paused' is not a valid JobState"):
        record().state = "paused"


def test_a_record_survives_the_wire():
    rec = record(JobState.QUEUED)
    wire = rec.to_wire()
    assert wire["state"] == "queued" and type(wire["state"]) is str
    assert JobRecord.from_wire(wire) == rec


@pytest.mark.parametrize("change,message", [
    ({"state": "paused"}, "state: not a job state: 'paused'"),
    ({"warm": 1}, "warm: expected bool, got int"),
    ({"exit_code": True}, "exit_code: expected int, got bool"),
    ({"id": None}, "id: expected str, got NoneType"),
    ({"timings": {"started_at": "soon"}}, "started_at: expected int or float, got str"),
    ({"artifacts": ["report.xml"]}, "artifacts: expected a list of JSON objects"),
])
def test_a_misshapen_record_is_refused_by_field(change: dict, message: str):
    with pytest.raises(WireError, match=re.escape(message)):
        JobRecord.from_wire({**record().to_wire(), **change})


def test_a_log_entry_refuses_data_that_is_not_base64():
    assert LogEntry.from_wire({"seq": 1, "stream": "stdout", "ts": 1.0, "data": "aGk="}).data == b"hi"
    with pytest.raises(WireError, match="data: not base64"):
        LogEntry.from_wire({"seq": 1, "stream": "stdout", "ts": 1.0, "data": "a!"})


def test_a_spec_leaves_the_services_defaults_to_the_service():
    spec = JobSpec(repository="octo/repo", sha="a" * 40, command="true", artifacts=("a.xml",))
    wire = spec.to_wire()
    assert "template" not in wire and "timeout_seconds" not in wire and wire["artifacts"] == ["a.xml"]
    config = ServiceConfig()
    parsed = spec_as_sent(wire, config)
    assert (parsed.template, parsed.timeout_seconds) == (config.default_template, config.default_timeout_seconds)
    # the service's own type for it: a JobSpec with every field decided (runner/service/jobs/job.py)
    assert parsed == AdmittedSpec(**{**spec.__dict__, "template": config.default_template,
                                     "timeout_seconds": config.default_timeout_seconds})


def py_files(*dirs: str) -> list[Path]:
    return [path for d in dirs for path in sorted((ROOT / d).rglob("*.py"))]


@pytest.mark.parametrize(("literal", "home"), [
    ('"/run/microvm-check/api.sock"', ["microvm_check/contract.py"]),  # the default socket, the SDK's too
    ("[0-9a-f]{40}", ["runner/jobapi/contract.py"]),  # the commit pattern
    ("A-Za-z0-9_.-]{1,100}", ["runner/jobapi/contract.py"]),  # the repository pattern
    # the job id pattern, and the sandbox's (a sandbox is a job record; test_sdk_contract holds them equal)
    ("j[0-9a-f]{16}", ["runner/jobapi/contract.py", "microvm_check/contract.py"]),
])
def test_the_contract_is_the_one_place_that_spells_it(literal: str, home: list[str]):
    """The job API's users (the action, the service, `run`, the benchmark, the SDK) import these; none spells
    its own."""
    spelled = [str(path.relative_to(ROOT)) for path in
               py_files("action", "runner/service", "runner/jobapi", "bench", "microvm_check")
               if literal in path.read_text()]
    assert spelled == home


def test_the_limits_a_client_checks_are_the_services():
    from action import inputs
    from runner.service.config import settings as config
    from runner.service.jobs import spec

    assert inputs.MAX_POLICY_BYTES is spec.MAX_POLICY_BYTES is contract.MAX_POLICY_BYTES
    assert inputs.DEFAULT_SOCKET is config.DEFAULT_SOCKET is contract.DEFAULT_SOCKET
