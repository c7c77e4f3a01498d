"""Fixtures for the tests of the service's decisions: a service on the stand-in engine (runner/sandbox/fake.py),
a private state dir and a real Unix socket. A plugin of tests/conftest.py, so the tests of the service's
packages, the job API's client and the commands share one definition; tests/vm/conftest.py's `engine` (a real
one) overrides this `engine` for the VM tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from runner.jobapi.client import JobClient
from runner.sandbox.fake import FakeSandboxes
from runner.service.config.reading import config_from_mapping
from runner.service.config.settings import ServiceConfig
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.service import JobService
from tests.service.service_fakes import BLOCKED


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short private directory: Unix socket paths must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="mvc-svc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_config(short_dir: Path) -> Callable[..., ServiceConfig]:
    def make(**settings: Any) -> ServiceConfig:
        base = {"socket": str(short_dir / "api.sock"), "state_dir": str(short_dir / "state")}
        return config_from_mapping({**base, **settings})
    return make


@pytest.fixture
def engine() -> FakeSandboxes:
    return FakeSandboxes(blocked=BLOCKED)


@pytest.fixture
def hosts(make_config: Callable[..., ServiceConfig], engine: FakeSandboxes) -> Iterator[Callable[..., ServiceHost]]:
    """Started `ServiceHost`s on the stand-in engine, closed at teardown; a job a test left running is
    cancelled then (shutdown_grace_seconds 0 unless the test sets it)."""
    with ExitStack() as stack:
        def make(serve_api: bool = True, **settings: Any) -> ServiceHost:
            config = make_config(**{"shutdown_grace_seconds": 0, **settings})
            return stack.enter_context(ServiceHost(config, sandboxes=engine.create, serve_api=serve_api))
        yield make


@pytest.fixture
def make_service(hosts: Callable[..., ServiceHost]) -> Callable[..., JobService]:
    """A started service without API servers: the test drives the `JobService` directly."""
    def make(**settings: Any) -> JobService:
        service = hosts(serve_api=False, **settings).service
        assert service is not None
        return service
    return make


@pytest.fixture
def make_host(hosts: Callable[..., ServiceHost]) -> Callable[..., ServiceHost]:
    """A started host without API servers: the test drives its `JobService` and the roles beside it
    (`host.desk`, `host.reactions`, `host.retention`) directly."""
    def make(**settings: Any) -> ServiceHost:
        return hosts(serve_api=False, **settings)
    return make


@pytest.fixture
def api(hosts: Callable[..., ServiceHost]) -> Callable[..., tuple[JobService, JobClient]]:
    """A started service served on its Unix socket (and on TCP when the settings say so), and a client that
    shows its answers as they are (retrying none: tests/jobapi/test_client_retry.py covers the waiting)."""
    def make(**settings: Any) -> tuple[JobService, JobClient]:
        host = hosts(**settings)
        assert host.service is not None
        return host.service, JobClient(socket=host.config.socket, retry_statuses=frozenset())
    return make
