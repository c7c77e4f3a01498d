"""A full queue does not fail the action's step: it waits as the service asks, says so, gives up in time.

The end-to-end test runs action.yml three times at once (action_harness, as the runner runs it) against
the real service (ServiceHost, real API over its Unix socket, `max_queued_jobs: 1`) with the local
stand-in for the VM (local_sandbox). The give-up path and the bounds on each wait are unit tests of
action/queuewait.py with a fake clock.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from action.queuewait import MAX_WAIT, MIN_WAIT, QueueTimeout, QueueWait
from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import JobSpec, JobState, JobSummary, QueueFullAnswer, WireError
from runner.service.config.reading import config_from_mapping
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.service import JobService
from tests.action.action_harness import FORK_PR, Simulation, StepProcess, start
from tests.action.local_sandbox import LocalEngine
from tests.reference import captured

QUEUED_LINE = "[microvm-check] the service's queue is full; queued behind 1 job, retrying in "
SPEC = JobSpec(repository="octo/hello", sha="a" * 40, command="true")

# -- the waiting, with a fake clock ----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@dataclass
class FullQueue:
    """A client whose submits meet a full queue `refusals` times, then succeed."""

    refusals: int = 10**9
    retry_after: float | None = 30
    queued: int | None = 3
    calls: int = 0

    def submit(self, spec: JobSpec) -> JobSummary:
        self.calls += 1
        if self.calls <= self.refusals:
            raise JobAPIError("POST /v1/jobs: 429 the job queue is full", status=429,
                              retry_after=self.retry_after, queued=self.queued)
        return JobSummary("j0123456789abcdef", JobState.AWAITING_CHECKOUT)


@dataclass
class Waiting:
    clock: FakeClock = field(default_factory=FakeClock)
    said: list[str] = field(default_factory=list)

    def wait(self, minutes: float, factor: float = 1.0) -> QueueWait:
        return QueueWait(minutes, say=self.said.append, clock=self.clock, sleep=self.clock.sleep,
                         uniform=lambda low, high: factor)


def test_gives_up_when_the_queue_stays_full_for_the_steps_timeout() -> None:
    w, client = Waiting(), FullQueue(retry_after=30, queued=3)
    with pytest.raises(QueueTimeout, match=r"^the job service's queue stayed full for 60 s \(3 jobs waiting to "
                                           r"start\), as long as timeout-minutes \(1\) allows; the job was not "
                                           r"submitted\. Run the workflow again later, or ask the service's "
                                           r"operator to raise max_queued_jobs or max_concurrent_jobs$"):
        w.wait(1).submit(client, SPEC)
    assert w.clock.slept == [30, 30] and client.calls == 3
    assert w.said == ["the service's queue is full; queued behind 3 jobs, retrying in 30 s"] * 2


def test_the_last_wait_is_cut_to_what_the_timeout_leaves() -> None:
    w, client = Waiting(), FullQueue(retry_after=20, queued=None)
    with pytest.raises(QueueTimeout, match=r"^the job service's queue stayed full for 30 s, as long as "
                                           r"timeout-minutes \(0\.5\) allows"):
        w.wait(0.5).submit(client, SPEC)
    assert w.clock.slept == [20, 10]
    assert w.said == ["the service's queue is full; retrying in 20 s", "the service's queue is full; retrying in 10 s"]


def test_submits_once_the_queue_has_room() -> None:
    w, client = Waiting(), FullQueue(refusals=2, retry_after=5, queued=1)
    assert w.wait(10).submit(client, SPEC).id == "j0123456789abcdef"
    assert w.clock.slept == [5, 5] and client.calls == 3


def test_other_refusals_are_not_waited_out() -> None:
    class Refuses:
        def submit(self, spec: JobSpec) -> JobSummary:
            raise JobAPIError("POST /v1/jobs: 503 the service is shutting down", status=503, retry_after=5)

    w = Waiting()
    with pytest.raises(JobAPIError, match="503 the service is shutting down"):
        w.wait(10).submit(Refuses(), SPEC)
    assert w.clock.slept == [] and w.said == []


@pytest.mark.parametrize(("retry_after", "factor", "expected"), [
    (0, 0.8, MIN_WAIT),  # no busy loop on a Retry-After of 0
    (3600, 1.2, MAX_WAIT),  # no hour-long sleep: the queue is looked at again
    (None, 1.0, 5.0),  # no Retry-After: the service's usual 5 s
    (10, 0.8, 8.0),
    (10, 1.2, 12.0),
])
def test_each_wait_is_bounded_and_jittered(retry_after: float | None, factor: float, expected: float) -> None:
    assert Waiting().wait(10, factor).delay(retry_after) == pytest.approx(expected)


def test_the_queue_full_answer_holds_a_count() -> None:
    assert QueueFullAnswer.from_wire({"error": "full", "queued": 2}) == QueueFullAnswer("full", 2)
    for queued in (-1, True, "2"):
        with pytest.raises(WireError, match="^queued: "):
            QueueFullAnswer.from_wire({"error": "full", "queued": queued})


# -- the real service ------------------------------------------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mvc-qf-", dir="/tmp"))  # Unix socket paths stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def service(short_dir: Path) -> Iterator[JobService]:
    engine = LocalEngine()
    config = config_from_mapping({"socket": str(short_dir / "api.sock"), "state_dir": str(short_dir / "state"),
                                  "max_queued_jobs": 1, "max_concurrent_jobs": 1, "shutdown_grace_seconds": 0})
    try:
        with ServiceHost(config, sandboxes=engine.create) as host:
            assert host.service is not None
            yield host.service
    finally:
        for sandbox in engine.created:
            sandbox.destroy()


def test_a_refused_submit_says_how_many_jobs_wait(service: JobService) -> None:
    with JobClient(socket=service.config.socket, retry_statuses=frozenset()) as client:
        blocker = client.submit(SPEC)  # awaiting its checkout, it holds the only slot
        with pytest.raises(JobAPIError, match=r"^POST /v1/jobs: 429 the job queue is full \(1 jobs waiting\)") as full:
            client.submit(SPEC)
        assert (full.value.status, full.value.retry_after, full.value.queued) == (429, 5, 1)
        client.cancel(blocker.id)


class Watched:
    """One action run whose log is read as it is written, to see it wait while the test holds the queue."""

    def __init__(self, sim: Simulation, inputs: dict[str, str]) -> None:
        _, steps = start(sim, inputs)
        self.step: StepProcess = steps[0]
        self.lines: list[str] = []
        self.was_queued = False
        self.seen = threading.Event()  # the queued line, or the end of the log without it
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.step.process.stdout:
            line = raw.decode("utf-8", "replace")
            self.lines.append(line)
            if line.startswith(QUEUED_LINE):
                self.was_queued = True
                self.seen.set()
        self.seen.set()

    def finish(self, timeout: float) -> tuple[int, str]:
        returncode = self.step.process.wait(timeout=timeout)
        self._reader.join(timeout)
        return returncode, "".join(self.lines)


def simulation(root: Path) -> Simulation:
    (root / "workspace").mkdir(parents=True)
    (root / "temp").mkdir()
    return Simulation(workspace=root / "workspace", temp=root / "temp",
                      event_payload=captured(FORK_PR))


def test_three_runs_into_a_queue_of_one_all_finish(service: JobService, tmp_path: Path) -> None:
    sims = [simulation(tmp_path / f"run{n}") for n in range(3)]
    with JobClient(socket=service.config.socket) as client:
        blocker = client.submit(SPEC)  # holds the only slot until every run has been refused at least once
        runs = [Watched(sim, {"run": f"echo run-{n} done", "socket": service.config.socket})
                for n, sim in enumerate(sims)]
        try:
            for n, run in enumerate(runs):
                assert run.seen.wait(120) and run.was_queued, "".join([f"run {n} did not wait:\n", *run.lines])
            client.cancel(blocker.id)
            results = [run.finish(timeout=300) for run in runs]
        finally:
            for run in runs:
                if run.step.process.poll() is None:
                    run.step.process.kill()
        for n, (returncode, log) in enumerate(results):
            assert returncode == 0, log
            assert f"run-{n} done" in log and QUEUED_LINE in log
        jobs = client.list(limit=10)
    assert sorted(job.state.value for job in jobs) == ["cancelled", "finished", "finished", "finished"]
    assert [job.exit_code for job in jobs if job.state is JobState.FINISHED] == [0, 0, 0]
