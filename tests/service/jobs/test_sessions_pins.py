"""Two decisions of a kept VM's session (runner/service/jobs/sessions.py, `_check_joinable`) that the other
session tests leave free: a later step runs under the policy the kept VM started with, and steps of
a job run one at a time in it."""

from __future__ import annotations

import threading

import pytest

from runner.jobapi.contract import JobState
from runner.sandbox.fake import FakeSandboxes, prints, waits
from runner.service.api.refusals import status_of
from runner.service.jobs.sessions import SessionConflict
from tests.service.jobs.test_service import wait_final
from tests.service.jobs.test_sessions import Job

BLOCK = "version: 1\nallow: []\n"
FAIL_ON_BLOCK = "version: 1\non_block: fail\nallow: []\n"


def test_a_later_step_with_another_egress_policy_is_refused(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    job = Job(service)
    job.step("ok", policy=BLOCK)
    with pytest.raises(SessionConflict, match="egress policy differs") as refused:
        job.submit("ok", keep="job", policy=FAIL_ON_BLOCK)
    assert status_of(refused.value) == 409
    host.desk.runner_job_completed("host-a")
    assert engine.alive() == []


def test_a_second_step_while_the_first_runs_in_the_kept_vm_is_refused(make_service, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs.update({"ok": prints(b""), "long": waits(release)})
    service = make_service()
    job = Job(service)
    job.step("ok")
    running = job.submit("long")
    # attached to the kept VM, so no checkout to wait for: queued, or already taken by a worker
    assert running.state in (JobState.QUEUED, JobState.STARTING, JobState.RUNNING)
    with pytest.raises(SessionConflict, match="another step of this job still runs") as refused:
        job.submit("ok")
    assert status_of(refused.value) == 409
    release.set()
    wait_final(service, running.id)
    job.step("ok", keep="none")
    assert engine.alive() == [] and len(engine.created) == 1
