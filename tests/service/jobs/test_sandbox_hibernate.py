"""Hibernate and resume on the stand-in engine (runner/service/jobs/sandboxes.py `hibernate`, `resume`): what
is refused in which state, what each restore point is kept for, and a parked sandbox's TTL. The real VMs,
the processes that live through it and the host's view of the stopped VM: tests/e2e/test_vm_sdk_hibernate.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from runner.jobapi.contract import JobState
from runner.sandbox.fake import FakeSandboxes
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.sandboxes import (
    LiveSandbox,
    Owner,
    SandboxDesk,
    SandboxNotFound,
    SandboxRequest,
    SandboxStateConflict,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def desk(hosts: Callable[..., ServiceHost], engine: FakeSandboxes) -> Iterator[tuple[SandboxDesk, list[str], Clock]]:
    host = hosts(serve_api=False, sandboxes={"max_live": 4, "max_per_caller": 4})
    assert host.service is not None
    forgotten: list[str] = []
    clock = Clock()
    desk = SandboxDesk(host.config, engine.create, host.service.policies, host.service.records.put,
                       forget_template=forgotten.append, clock=clock)
    try:
        yield desk, forgotten, clock
    finally:
        desk.close()


def _create(desk: SandboxDesk, ttl: float = 300) -> LiveSandbox:
    sandbox, _token = desk.create(Owner("uid 4242"), SandboxRequest.parse({"ttl_seconds": ttl}, desk.config))
    return sandbox


def test_a_hibernated_sandbox_has_no_vm_refuses_calls_and_resumes_from_its_restore_point(desk, engine) -> None:
    desk, forgotten, _clock = desk
    sandbox = _create(desk)
    first_vm = sandbox.vm
    desk.hibernate(sandbox)
    assert first_vm.destroyed.is_set() and first_vm.snapshots == [f"sbx-{sandbox.id}-h1"]
    info = desk.info(sandbox)
    assert (info.state, info.vm_id) == ("hibernated", None)
    with pytest.raises(SandboxStateConflict, match="is hibernated: resume it first"):
        with desk.call(sandbox):
            pass
    with pytest.raises(SandboxStateConflict, match="hibernated already"):
        desk.hibernate(sandbox)
    desk.resume(sandbox)
    assert sandbox.vm is not first_vm and sandbox.vm.request.template == f"sbx-{sandbox.id}-h1"
    assert desk.info(sandbox).state == "running" and desk.info(sandbox).vm_id == sandbox.vm.id
    with pytest.raises(SandboxStateConflict, match="is not hibernated"):  # one hibernated state, one resume
        desk.resume(sandbox)
    assert forgotten == []  # the resumed VM's disk lies over h1
    desk.hibernate(sandbox)
    assert forgotten == [f"sbx-{sandbox.id}-h1"]  # h2 took its place
    desk.resume(sandbox)
    desk.end(sandbox, JobState.FINISHED, "destroyed by its caller")
    assert forgotten == [f"sbx-{sandbox.id}-h1", f"sbx-{sandbox.id}-h2"]
    assert [s.destroyed.is_set() for s in engine.created] == [True, True, True]


def test_a_hibernate_with_a_call_under_way_is_refused_and_the_sandbox_runs_on(desk) -> None:
    desk, forgotten, _clock = desk
    sandbox = _create(desk)
    with desk.call(sandbox):
        with pytest.raises(SandboxStateConflict, match="1 call"):
            desk.hibernate(sandbox)
    assert not sandbox.parked and sandbox.vm.alive and forgotten == []


def test_a_parked_sandbox_is_reaped_at_its_ttl_with_its_restore_point_and_resumes_for_what_is_left(desk, engine) -> None:
    desk, forgotten, clock = desk
    parked, keeps = _create(desk, ttl=300), _create(desk, ttl=600)
    desk.hibernate(keeps)
    desk.hibernate(parked)
    clock.now += 100
    desk.resume(keeps)
    assert keeps.vm.request.ttl_seconds == pytest.approx(500 + 60)  # what is left, and the engine's margin
    clock.now += 250
    assert desk.reap() == [parked.id]
    assert parked.record.state is JobState.TIMED_OUT and forgotten == [f"sbx-{parked.id}-h1"]
    with pytest.raises(SandboxNotFound):
        desk.resume(parked)
    assert keeps.vm.alive


def test_a_resume_that_finds_the_sandbox_ended_meanwhile_destroys_the_vm_it_made(desk, engine) -> None:
    desk, _forgotten, _clock = desk
    sandbox = _create(desk)
    desk.hibernate(sandbox)
    create = engine.create

    def ended_while_restoring(request):  # type: ignore[no-untyped-def]
        vm = create(request)
        desk.end(sandbox, JobState.TIMED_OUT, "its TTL passed: the service destroyed it")
        return vm

    desk._create_vm = ended_while_restoring
    with pytest.raises(SandboxNotFound, match="TTL passed"):
        desk.resume(sandbox)
    assert engine.created[-1].destroyed.is_set()


def test_a_restore_point_is_no_base_for_a_create_not_even_its_owners(desk) -> None:
    desk, _forgotten, _clock = desk
    sandbox = _create(desk)
    desk.hibernate(sandbox)
    with pytest.raises(SandboxNotFound, match="no snapshot of yours by that name"):
        desk.create(sandbox.owner, SandboxRequest.parse({"base": f"sbx-{sandbox.id}-h1"}, desk.config))


def test_an_end_while_the_snapshot_is_made_leaves_no_restore_point_and_no_parked_record(desk, engine) -> None:
    desk, forgotten, _clock = desk
    sandbox = _create(desk)
    snapshot = sandbox.vm.snapshot

    def ended_while_snapshotting(name: str, extra: dict[str, object] | None = None) -> None:
        desk.end(sandbox, JobState.FINISHED, "destroyed by its caller")  # releases the snapshot before it exists
        snapshot(name, extra=extra)

    sandbox.vm.snapshot = ended_while_snapshotting
    with pytest.raises(SandboxNotFound, match="destroyed by its caller"):
        desk.hibernate(sandbox)
    assert forgotten.count(f"sbx-{sandbox.id}-h1") == 2  # at the end's release, and again once it was made
    assert sandbox.record.state is JobState.FINISHED and sandbox.record.vm_id is not None


def test_a_vm_that_fails_to_go_still_leaves_the_sandbox_parked_and_resumable(desk) -> None:
    desk, _forgotten, _clock = desk
    sandbox = _create(desk)

    def fails() -> None:
        raise RuntimeError("the VMM could not be killed")

    sandbox.vm.destroy = fails
    desk.hibernate(sandbox)
    assert desk.info(sandbox).state == "hibernated"
    desk.resume(sandbox)
    assert desk.info(sandbox).state == "running"


def test_what_its_vms_were_refused_before_a_hibernate_stays_in_its_record(desk, engine) -> None:
    from microvm_check.entries import AuditRecord

    desk, _forgotten, _clock = desk
    before = AuditRecord("203.0.113.9", 443, "tcp", "before.example", 1)
    after = AuditRecord("203.0.113.10", 443, "tcp", "after.example", 1)
    engine.blocked = [before]
    sandbox = _create(desk)
    desk.hibernate(sandbox)
    engine.blocked = [after]
    desk.resume(sandbox)
    desk.end(sandbox, JobState.FINISHED, "destroyed by its caller")
    assert [r.name for r in sandbox.record.blocked_egress] == ["before.example", "after.example"]


def test_an_end_while_a_resume_restores_keeps_its_restore_point_until_then_and_answers_404(desk) -> None:
    from runner.errors import SandboxError

    desk, forgotten, _clock = desk
    sandbox = _create(desk)
    desk.hibernate(sandbox)
    point = sandbox.restore_point

    def ended_then_failed(request):  # type: ignore[no-untyped-def]
        desk.end(sandbox, JobState.FINISHED, "destroyed by its caller")
        assert point not in forgotten, "the restore point was removed under the restore"
        raise SandboxError("the restore failed")

    desk._create_vm = ended_then_failed
    with pytest.raises(SandboxNotFound, match="destroyed by its caller"):  # not a 503 "try again"
        desk.resume(sandbox)
    assert forgotten == [point]
