"""A job's command started as an argv (runner/service/jobs/command.py) falls back to `sh -c` only when nothing of
it ran, and then within the step's one deadline (ATTACK2 finding 1: a guest's failure after the program
started must not run the command a second time, nor give the step a second full timeout)."""

from __future__ import annotations

from collections.abc import Callable

from runner.errors import SandboxError
from runner.sandbox.fake import FakeSandbox, FakeSandboxes, prints
from runner.sandbox.sandbox import ExecResult
from runner.service.jobs.service import JobService
from tests.service.jobs.test_service import run, wait_final


def test_a_program_the_guest_cannot_start_is_started_through_the_shell_within_the_same_deadline(
        make_service: Callable[..., JobService], engine: FakeSandboxes) -> None:
    engine.programs["make check"] = prints(b"via the shell\n", 0)
    engine.unstartable.add("make")
    service = make_service()
    job = run(service, "make check", timeout_seconds=40)
    wait_final(service, job)
    assert (service.get(job).state, service.get(job).exit_code) == ("finished", 0)
    calls = engine.created[0].exec_calls
    assert [c["command"] for c in calls] == [["make", "check"], ["sh", "-c", "make check"]]
    assert calls[0]["timeout"] <= 40 and calls[1]["timeout"] <= calls[0]["timeout"]


def test_a_failure_after_the_program_started_is_the_jobs_and_runs_nothing_else(
        make_service: Callable[..., JobService], engine: FakeSandboxes) -> None:
    def fails_after_starting(sbx: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
        out("stdout", b"publishing...\n")
        raise SandboxError("exec failed in the guest: the output pump died")  # the VM lives on

    engine.programs["make publish"] = fails_after_starting
    service = make_service()
    job = run(service, "make publish")
    wait_final(service, job)
    assert service.get(job).state == "failed"
    assert [c["command"] for c in engine.created[0].exec_calls] == [["make", "publish"]]
