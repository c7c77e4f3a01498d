"""Warm bases without VMs: what a service without networking builds, and what close() ends."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

from runner.sandbox.fake import FakeSandbox, FakeSandboxes, waits
from runner.service.jobs.bases import BaseSettings, RepositoryBases
from tests.service.service_fakes import checkout_tar

SETTINGS = BaseSettings(parent="base", budget_bytes=1 << 30, setup_timeout_s=60, max_checkout_bytes=1 << 20)


def bases(sandboxes: FakeSandboxes) -> RepositoryBases:
    warm_for = lambda repository: (SimpleNamespace(setup="true", inputs=()), None)  # noqa: E731
    return RepositoryBases(sandboxes, warm_for, github=None, settings=SETTINGS)  # type: ignore[arg-type]


def test_a_service_without_networking_never_builds_a_networked_base() -> None:
    sandboxes = FakeSandboxes(networked=False)
    created = sandboxes.created
    subject = bases(sandboxes)
    subject._fresh_digest = lambda repository, spec: "d"  # type: ignore[method-assign]
    assert subject.template_for("o/r", network=True) == "base"
    assert subject._building == {} and created == []


def test_close_ends_a_running_build_and_joins_its_thread() -> None:
    sandboxes = FakeSandboxes(programs={"true": waits()})  # a setup that runs until its VM is destroyed
    subject = bases(sandboxes)
    started = threading.Event()
    original = subject._setup_and_snapshot

    def setup(*args: Any) -> Any:
        started.set()
        return original(*args)

    subject.build = lambda repository, network, ref: setup(repository, "n", network, "d",  # type: ignore[method-assign]
                                                           SimpleNamespace(setup="true"), None, checkout_tar(), {})
    assert subject.rebuild_beside("o/r", network=False)
    assert started.wait(30)
    sandbox = _the_build_vm(sandboxes)
    subject.close(timeout=30)
    assert sandbox.destroyed.is_set()
    assert not any(thread.is_alive() for thread in subject._building.values())
    assert subject.rebuild_beside("o/r", network=False) is False, "no new build after close"


def _the_build_vm(sandboxes: FakeSandboxes) -> FakeSandbox:
    """The VM the build started in (restored just after the build began)."""
    for _ in range(3000):
        if sandboxes.created:
            return sandboxes.created[0]
        time.sleep(0.01)
    raise AssertionError("the build never restored its VM")
