"""The job API's one table from domain errors to HTTP statuses (runner.service.api.refusals.STATUS)."""

from __future__ import annotations

import logging

import pytest

from runner.errors import JobError, SandboxError
from runner.jobapi.client import JobAPIError
from runner.service.api.refusals import STATUS, status_of
from runner.service.jobs.egress import PolicySourceUnavailable
from runner.service.jobs.jobqueue import QueueFull
from runner.service.jobs.sandboxes import SandboxLimit, SandboxUnavailable
from tests.error_tree import exception_classes, qualified


def test_every_job_error_has_its_own_status() -> None:
    """A new refusal must choose its status here, not inherit one by accident."""
    refusals = [cls for cls in exception_classes() if issubclass(cls, JobError)]
    assert len(refusals) > 10
    assert [qualified(cls) for cls in refusals if cls not in STATUS] == []
    assert all(400 <= status < 500 or status == 503 for status in STATUS.values())


def _instance(cls: type[JobError]) -> JobError:
    return QueueFull(4, 7) if cls is QueueFull else cls("refused: the message a client reads")


@pytest.mark.parametrize("cls", sorted(STATUS, key=qualified), ids=qualified)
def test_each_refusal_is_answered_with_its_status_and_message(cls: type[JobError], api, monkeypatch) -> None:
    service, client = api()
    error = _instance(cls)
    monkeypatch.setattr(service, "health", lambda: (_ for _ in ()).throw(error))
    with pytest.raises(JobAPIError) as refused:
        client.health()
    assert refused.value.status == status_of(error) == STATUS[cls]
    assert str(error) in str(refused.value)
    asked = {QueueFull: 7, PolicySourceUnavailable: PolicySourceUnavailable.retry_after,  # they say when to come back
             SandboxLimit: SandboxLimit.retry_after, SandboxUnavailable: SandboxUnavailable.retry_after}
    assert refused.value.retry_after == asked.get(cls)


def test_another_areas_error_at_the_edge_is_a_500_with_its_traceback_logged(api, monkeypatch, caplog) -> None:
    """Only refusals are the client's to read; a sandbox error reaching a route is the service's bug."""
    service, client = api()
    monkeypatch.setattr(service, "health", lambda: (_ for _ in ()).throw(SandboxError("the VM died")))
    with pytest.raises(JobAPIError, match="500 internal error in the job service; see its log") as failed:
        client.health()
    assert failed.value.status == 500
    assert any(r.exc_info and r.levelno == logging.ERROR for r in caplog.records)
