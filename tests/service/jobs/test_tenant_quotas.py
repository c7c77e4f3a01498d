"""Per-tenant shares of the queue and of the VMs (issue 17): one repository or runner flooding the queue
leaves room for the others, and a repository that queued first does not keep another's job waiting.

Jobs come from fleet runners (tenants, unlike the operator) into a real JobService; VMs are the
FakeSandboxes's. Before, one tenant's submits took every slot of the queue and others got 429.
"""

from __future__ import annotations

import threading

import pytest

from runner.jobapi.contract import GitHubJob, JobStarted
from runner.sandbox.fake import FakeSandboxes, waits
from runner.service.jobs.auth import Caller, Kind
from runner.service.jobs.jobqueue import JobQueue, QueueFull
from tests.service.service_fakes import checkout_tar, spec


def runner(service, name: str, repository: str) -> Caller:
    """A fleet runner whose job-started hook reported a job of `repository` (run 7, job "test"), which the
    fork guard let run (what runner/service/github/desk.py does with a verdict that allows it)."""
    service.access.runners.add(name, f"token-of-{name}-0123456789")
    started = JobStarted(GitHubJob(repository, 7, 1, "test", name), f"{repository}/.github/w.yml@main", "push")
    service.access.runners.bind(name, started)
    service.access.runners.allow(name, started)
    return Caller(Kind.RUNNER, f"runner {name}", runner=name)


def test_one_runner_flooding_the_queue_leaves_room_for_others(make_service) -> None:
    service = make_service(max_queued_jobs=8, max_concurrent_jobs=1)
    flooder = runner(service, "r1", "octo/flood")
    held = []
    with pytest.raises(QueueFull, match="runner r1 already has 2 jobs waiting"):
        for _ in range(8):  # never uploads a checkout: each submit holds a slot for checkout_wait_seconds
            held.append(service.submit_as(flooder, spec("true", repository="octo/flood", run_id=7))[0])
    assert len(held) == 2
    other = service.submit_as(runner(service, "r2", "octo/other"), spec("true", repository="octo/other", run_id=7))[0]
    assert other.state == "awaiting_checkout"


def test_one_repositorys_runners_hold_at_most_half_the_queue(make_service) -> None:
    service = make_service(max_queued_jobs=8, max_concurrent_jobs=1)
    with pytest.raises(QueueFull, match="repository octo/flood already has 4 jobs waiting"):
        for n in range(8):
            service.submit_as(runner(service, f"f{n}", "octo/flood"), spec("true", repository="octo/flood", run_id=7))
    other = service.submit_as(runner(service, "r2", "octo/other"), spec("true", repository="octo/other", run_id=7))[0]
    assert other.state == "awaiting_checkout"


def test_a_runner_holds_at_most_its_share() -> None:
    queue = JobQueue(32, max_queued={"runner": 2, "repository": 16})
    queue.reserve("a", {"runner": "r1", "repository": "o/x"})
    queue.reserve("b", {"runner": "r1", "repository": "o/x"})
    with pytest.raises(QueueFull, match="runner r1 already has 2 jobs waiting"):
        queue.reserve("c", {"runner": "r1", "repository": "o/x"})
    queue.reserve("d", {"runner": "r2", "repository": "o/x"})
    assert queue.discard("a")
    queue.reserve("c", {"runner": "r1", "repository": "o/x"})  # a discarded job gives its slot back


def test_the_repository_with_the_fewest_running_goes_first_and_caps_hold() -> None:
    queue = JobQueue(32, max_running={"repository": 2})
    for n in range(4):
        queue.reserve(f"big{n}", {"repository": "o/big"})
        queue.put(f"big{n}")
    queue.reserve("small", {"repository": "o/small"})
    queue.put("small")
    assert queue.get() == "big0"
    assert queue.get() == "small"  # o/big runs one, o/small none: o/small's job goes ahead of big1
    assert queue.get() == "big1"
    taken: list[str | None] = []
    worker = threading.Thread(target=lambda: taken.append(queue.get()))
    worker.start()  # o/big runs 2 of 2: its next job waits for one of them to end
    worker.join(0.2)
    assert taken == []
    queue.finished("big0")
    worker.join(10)
    assert taken == ["big2"]


def test_the_operators_jobs_are_no_tenants(make_service, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs["block"] = waits(release)
    service = make_service(max_queued_jobs=4, max_concurrent_jobs=1)
    jobs = [service.submit(spec("block", repository="octo/mine")) for _ in range(4)]
    assert [job.state for job in jobs] == ["awaiting_checkout"] * 4
    for job in jobs:
        service.put_checkout(job.id, [checkout_tar()])
    release.set()
