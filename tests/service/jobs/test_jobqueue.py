"""The bounded queue: reservations at submit, order, cancel, close."""

from __future__ import annotations

import threading

import pytest

from runner.service.jobs.jobqueue import JobQueue, QueueClosed, QueueFull


def test_reservations_count_against_capacity() -> None:
    q = JobQueue(capacity=2, retry_after=7)
    q.reserve("a")
    q.reserve("b")
    with pytest.raises(QueueFull, match=r"^the job queue is full \(2 jobs waiting\); retry in 7 s$") as full:
        q.reserve("c")
    assert full.value.retry_after == 7
    assert q.counts() == (0, 2)
    q.put("a")
    assert q.counts() == (1, 1)
    assert q.get() == "a"  # taking a job frees its slot
    q.reserve("c")


def test_fifo_order_and_put_needs_a_reservation() -> None:
    q = JobQueue(capacity=5)
    for name in "xyz":
        q.reserve(name)
    for name in "zxy":
        q.put(name)
    assert [q.get(), q.get(), q.get()] == ["z", "x", "y"]
    with pytest.raises(KeyError, match="never-reserved"):
        q.put("never-reserved")


def test_discard_frees_waiting_jobs_only() -> None:
    q = JobQueue(capacity=1)
    q.reserve("a")
    q.put("a")
    assert q.discard("a") is True
    assert q.discard("a") is False
    q.reserve("b")  # the slot is free again
    q.put("b")
    assert q.get() == "b"
    assert q.discard("b") is False  # a worker owns it now


def test_close_wakes_workers_and_returns_the_rest() -> None:
    q = JobQueue(capacity=3)
    got: list[str | None] = []
    worker = threading.Thread(target=lambda: got.append(q.get()))
    worker.start()
    q.reserve("a")
    q.reserve("b")
    q.put("a")
    worker.join(10)
    assert got == ["a"]
    waiting = threading.Thread(target=lambda: got.append(q.get()))
    waiting.start()
    assert sorted(q.close()) == ["b"]
    waiting.join(10)
    assert got == ["a", None]
    with pytest.raises(QueueClosed, match="^the service is shutting down; submit the job again later$"):
        q.reserve("c")
