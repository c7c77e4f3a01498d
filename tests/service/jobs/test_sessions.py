"""`keep: job`: one VM across a GitHub job's steps, against the stand-in engine (runner/service/jobs/sessions.py).

The real-VM proof (files and a background process across steps, driven through action.yml) is
tests/action/test_action_vm_keep.py.
"""

from __future__ import annotations

import pytest

from runner.jobapi.contract import JobState
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.api.refusals import status_of
from runner.service.jobs.admission import InvalidJob
from runner.service.jobs.auth import OPERATOR
from runner.service.jobs.service import JobService, JobStateConflict
from runner.service.jobs.sessions import SessionConflict
from tests.service.jobs.test_service import GitHubJob, wait_final
from tests.service.service_fakes import checkout_tar, spec

JOB = {"run_id": 500, "run_attempt": 1, "job_name": "check", "runner_name": "host-a"}


class Job:
    """One GitHub job's steps as the action runs them: the session token a step was answered goes
    with the job's next submit (the action keeps it in RUNNER_TEMP), and is forgotten after a `keep: none` step."""

    def __init__(self, service: JobService) -> None:
        self.service, self.token = service, None

    def submit(self, command: str, keep: str = "job", **fields):
        record, _, opened = self.service.submit_as(OPERATOR, spec(command, keep=keep, **{**JOB, **fields}), self.token)
        self.token = opened or (self.token if keep == "job" else None)
        return record

    def step(self, command: str, keep: str = "job", **fields) -> str:
        """Submit one step, uploading a checkout only when the service waits for one."""
        record = self.submit(command, keep, **fields)
        if record.state == JobState.AWAITING_CHECKOUT:
            self.service.put_checkout(record.id, [checkout_tar()])
        wait_final(self.service, record.id)
        return record.id


def step(service: JobService, command: str, keep: str = "job", **fields) -> str:
    """A step of the service's one test job (`Job`, remembered on the service object)."""
    job = service.__dict__.setdefault("_test_job", Job(service))
    return job.step(command, keep, **fields)


def test_steps_share_one_vm_each_with_its_own_exit_code_and_the_last_ends_it(make_service, engine: FakeSandboxes) -> None:
    engine.programs.update({"install": prints(b"i\n"), "lint": prints(b"l\n", 3), "test": prints(b"t\n")})
    service = make_service()
    first, second = step(service, "install"), step(service, "lint")
    assert len(engine.created) == 1 and engine.alive() == engine.created  # kept after a failing step too
    third = step(service, "test", keep="none")
    records = [service.get(job) for job in (first, second, third)]
    assert [(r.state, r.exit_code) for r in records] == [("finished", 0), ("finished", 3), ("finished", 0)]
    assert {r.vm_id for r in records} == {engine.created[0].id}
    vm = engine.created[0]
    # plain words start without a shell, but `test` is a builtin of the shell (runner/service/jobs/command.py)
    assert [call["command"] for call in vm.exec_calls] == [["install"], ["lint"], ["sh", "-c", "test"]]
    assert vm.files == {"/workspace/README": b"hello\n"}  # the checkout went in once
    assert engine.alive() == [] and service.sessions.count() == 0


def test_an_attached_step_is_queued_without_a_checkout(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    step(service, "ok")
    record = service._test_job.submit("ok", keep="job")
    assert record.state != JobState.AWAITING_CHECKOUT  # queued at once: the action reads this, sends no checkout
    with pytest.raises(JobStateConflict, match="already uploaded or it ended"):
        service.put_checkout(record.id, [checkout_tar()])
    wait_final(service, record.id)
    host.desk.runner_job_completed("host-a")
    assert engine.alive() == []


@pytest.mark.parametrize("other", [{"runner_name": "host-b"}, {"run_attempt": 2}, {"run_id": 501},
                                   {"job_name": "lint"}, {"repository": "octo/other"}])
def test_a_step_of_another_job_never_attaches(make_host, engine: FakeSandboxes, other) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    step(service, "ok")
    kept = engine.created[0]
    step(service, "ok", keep="none", **other)
    assert len(engine.created) == 2 and engine.created[1].exec_calls and kept.alive
    assert len(kept.exec_calls) == 1
    host.desk.runner_job_completed("host-a")
    assert engine.alive() == []


@pytest.mark.parametrize("end", [
    lambda host: host.desk.runner_job_completed("host-a"),
    lambda host: host.desk.runner_died("host-a", "the runner died"),
    lambda host: host.reactions.job_completed(GitHubJob(job_id=9, run_id=500, job_name="check (x)",
                                                        runner_name="host-a", repository="octo/hello")),
])
def test_the_job_end_destroys_the_kept_vm(make_host, engine: FakeSandboxes, end) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    step(service, "ok")
    assert engine.alive() == engine.created
    end(host)
    assert engine.alive() == [] and service.sessions.count() == 0


def test_an_idle_session_expires(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    step(service, "ok")
    service.sessions.idle_seconds = 0.0
    host.retention.reap()
    assert engine.alive() == []
    assert service.get(step(service, "ok", keep="none")).exit_code == 0  # a fresh VM: the session is gone
    assert len(engine.created) == 2 and engine.alive() == []


def test_a_step_that_asks_for_another_template_is_refused(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host(templates=["base", "other"])
    service = host.service
    step(service, "ok")
    with pytest.raises(SessionConflict, match="kept VM was restored from template base, this step asks for other") as refused:
        service._test_job.submit("ok", keep="job", template="other")
    assert status_of(refused.value) == 409
    host.desk.runner_job_completed("host-a")
    assert engine.alive() == []


def test_keep_is_checked(make_service) -> None:
    service = make_service()
    with pytest.raises(InvalidJob, match="keep: expected one of none, job"):
        service.submit(spec("ok", keep="forever", **JOB))
    with pytest.raises(InvalidJob, match="keep: job needs the GitHub job's run_id"):
        service.submit(spec("ok", keep="job"))


def test_a_later_job_with_the_same_identity_but_no_token_gets_a_vm_of_its_own(make_service, engine: FakeSandboxes) -> None:
    """The key's values are what a client sends: another job (or nektos/act reusing run ids) can send
    them too. Without the session's token it neither attaches to the kept VM nor ends it."""
    engine.programs.update({"ok": prints(b""), "peek": prints(b"", 1)})
    service = make_service()
    first = Job(service)
    first.step("ok")
    kept = engine.created[0]
    impostor = Job(service)
    impostor.step("peek", keep="job")
    impostor.step("peek", keep="none")
    assert len(engine.created) == 2 and kept.alive and len(kept.exec_calls) == 1
    assert service.sessions.count() == 1  # the impostor's own session ended with its `keep: none` step
    last = first.step("ok", keep="none")
    assert service.get(last).vm_id == kept.id and engine.alive() == []


def test_a_forged_or_stale_session_token_opens_nothing(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    first = Job(service)
    first.step("ok")
    forged = Job(service)
    forged.token = "x" * 43
    record, _, opened = service.submit_as(OPERATOR, spec("ok", keep="none", **JOB), forged.token)
    assert opened is None and record.state == JobState.AWAITING_CHECKOUT  # a plain step: a VM of its own
    service.cancel(record.id)
    assert engine.created[0].alive
    host.desk.runner_job_completed("host-a")
    assert engine.alive() == []


def test_the_service_log_says_kept_for_a_kept_vm_and_destroyed_at_the_end(make_service, engine: FakeSandboxes,
                                                                          caplog) -> None:
    """Before: every step of a `keep: job` job logged "VM ... destroyed", although the VM lived on."""
    import logging

    engine.programs.update({"install": prints(b"i\n"), "test": prints(b"t\n")})
    service = make_service()
    with caplog.at_level(logging.INFO, logger="runner.jobs"):
        first, last = step(service, "install"), step(service, "test", keep="none")
    vm = engine.created[0].id
    said = {job: [r.getMessage() for r in caplog.records if r.name == "runner.jobs" and job in r.getMessage()]
            for job in (first, last)}
    assert f"job {first} VM {vm} kept for the job's next step" in said[first]
    assert not any("destroyed" in line for line in said[first])
    assert f"job {last} VM {vm} destroyed" in said[last]
