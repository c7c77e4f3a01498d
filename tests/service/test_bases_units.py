"""Warm bases without VMs: what a service without networking builds, and what close() ends."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from runner.service.jobs.bases import BaseSettings, RepositoryBases
from tests.service.service_fakes import FakeProvider

SETTINGS = BaseSettings(parent="base", budget_bytes=1 << 30, setup_timeout_s=60, max_checkout_bytes=1 << 20)


def bases(create: Any, networked: bool = False) -> RepositoryBases:
    warm_for = lambda repository: (SimpleNamespace(setup="true", inputs=()), None)  # noqa: E731
    return RepositoryBases(FakeProvider(create, networked), warm_for, github=None, settings=SETTINGS)  # type: ignore[arg-type]


def test_a_service_without_networking_never_builds_a_networked_base() -> None:
    created: list[dict[str, Any]] = []
    subject = bases(lambda request: created.append(request))
    subject._fresh_digest = lambda repository, spec: "d"  # type: ignore[method-assign]
    assert subject.template_for("o/r", network=True) == "base"
    assert subject._building == {} and created == []


class _HangingSandbox:
    """A build's VM whose setup runs until the VM is destroyed."""

    def __init__(self) -> None:
        self.destroyed = threading.Event()

    def put_tar(self, stream: Any) -> None:
        pass

    def exec(self, command: str, **kwargs: Any) -> Any:
        self.destroyed.wait(60)
        return SimpleNamespace(exit_code=137, timed_out=False)

    def destroy(self) -> None:
        self.destroyed.set()


def test_close_ends_a_running_build_and_joins_its_thread() -> None:
    sandbox = _HangingSandbox()
    subject = bases(lambda request: sandbox)
    started = threading.Event()
    original = subject._setup_and_snapshot

    def setup(*args: Any) -> Any:
        started.set()
        return original(*args)

    subject.build = lambda repository, network, ref: setup(repository, "n", network, "d",  # type: ignore[method-assign]
                                                           SimpleNamespace(setup="true"), None, b"", {})
    assert subject.rebuild_beside("o/r", network=False)
    assert started.wait(30)
    subject.close(timeout=30)
    assert sandbox.destroyed.is_set()
    assert not any(thread.is_alive() for thread in subject._building.values())
    assert subject.rebuild_beside("o/r", network=False) is False, "no new build after close"
