"""Base builds are a shared resource (issue 17): the host builds at most `max_concurrent_builds` at once, so a
template change that makes every base stale rebuilds them one by one, and a base whose setup keeps failing
is not rebuilt on every job but backs off, doubling. No VMs: the builds are stand-ins."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from runner.sandbox.fake import FakeSandboxes
from runner.service.jobs.bases import BaseSettings, RepositoryBases

SETTINGS = BaseSettings(parent="base", budget_bytes=1 << 30, setup_timeout_s=60, max_checkout_bytes=1 << 20,
                        max_concurrent_builds=1, failure_backoff_s=60)


def bases(settings: BaseSettings = SETTINGS) -> RepositoryBases:
    warm_for = lambda repository: (SimpleNamespace(setup="true", inputs=()), None)  # noqa: E731
    return RepositoryBases(FakeSandboxes(), warm_for, github=None, settings=settings)  # type: ignore[arg-type]


def test_stale_bases_of_many_repositories_are_rebuilt_one_at_a_time() -> None:
    subject = bases()
    running, most, done = [0], [0], []
    lock = threading.Lock()

    def build(repository: str, network: bool, ref: Any) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            done.append(repository)

    subject.build = build  # type: ignore[method-assign]
    repositories = [f"o/r{n}" for n in range(6)]
    assert all(subject.rebuild_beside(r, network=False) for r in repositories)  # a template change: all stale
    for repository in repositories:
        subject.wait(repository, timeout=30)
    assert sorted(done) == repositories and most[0] == 1


def test_two_builds_at_once_when_the_operator_says_so() -> None:
    subject = bases(replace(SETTINGS, max_concurrent_builds=2))
    both = threading.Barrier(2, timeout=30)
    subject.build = lambda repository, network, ref: both.wait()  # type: ignore[method-assign]
    assert subject.rebuild_beside("o/a", network=False) and subject.rebuild_beside("o/b", network=False)
    subject.wait("o/a", timeout=30)
    subject.wait("o/b", timeout=30)
    assert not both.broken


def test_a_failing_setup_backs_off_doubling_then_a_success_resets_it() -> None:
    subject = bases()
    now = [1000.0]
    subject.clock = lambda: now[0]
    outcome = {"fail": True}
    calls = []

    def build(repository: str, network: bool, ref: Any) -> None:
        calls.append(now[0])
        if outcome["fail"]:
            raise RuntimeError("warm.setup exited 1")

    subject.build = build  # type: ignore[method-assign]

    def attempt() -> bool:
        started = subject.rebuild_beside("o/r", network=False)
        subject.wait("o/r", timeout=30)
        return started

    assert attempt()  # fails: not again for 60 s
    now[0] += 59
    assert not attempt()  # every job in the back-off restores from what there is, no build
    now[0] += 2
    assert attempt()  # fails again: 120 s now
    now[0] += 119
    assert not attempt()
    now[0] += 2
    outcome["fail"] = False
    assert attempt() and attempt()  # a success ends the back-off
    assert len(calls) == 4
