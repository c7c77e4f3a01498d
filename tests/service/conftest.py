"""Fixtures for the job service tests: a service on a private state dir and a real Unix socket."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from service_fakes import FakeEngine

from runner.service.api import ApiServers
from runner.service.client import JobClient
from runner.service.config import ServiceConfig, config_from_mapping
from runner.service.service import JobService

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
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def make_service(make_config: Callable[..., ServiceConfig], engine: FakeEngine) -> Iterator[Callable[..., JobService]]:
    started: list[JobService] = []

    def make(**settings: Any) -> JobService:
        service = JobService(make_config(**settings), engine.create)
        service.start()
        started.append(service)
        return service

    yield make
    for service in started:
        if not service.stopping:
            service.shutdown(0)
        service.close()


@pytest.fixture
def api(make_service: Callable[..., JobService]) -> Iterator[Callable[..., tuple[JobService, JobClient]]]:
    servers: list[ApiServers] = []

    def make(**settings: Any) -> tuple[JobService, JobClient]:
        service = make_service(**settings)
        server = ApiServers(service)
        server.start()
        servers.append(server)
        return service, JobClient(socket=service.config.socket)

    yield make
    for server in servers:
        server.stop()

