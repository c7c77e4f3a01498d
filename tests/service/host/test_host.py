"""`ServiceHost`: the one place the service is built; pieces closed newest first, also when a later one
fails to start, and nothing of them left (threads, sockets, the engine's lock, the socket file).

The engine here is a real one (root and QEMU's binary; no VM is started), the sandboxes a stand-in
where the VM layer is not the point.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.errors import ConfigError, SandboxError
from runner.jobapi.client import JobAPIError, JobClient
from runner.sandbox.fake import FakeSandboxes, waits
from runner.service.api.listeners import ApiServers
from runner.service.config.settings import ServiceConfig
from runner.service.github.webhook import Webhook
from runner.service.host.assembly import EngineSettings, ServiceHost
from runner.service.jobs.service import JobService
from tests.conftest import require
from tests.service.service_fakes import baked_template, checkout_tar, spec

TOKEN = "t" * 32
PIECE_THREADS = ("job-worker", "job-reaper", "api-unix", "api-tcp", "github-webhooks", "redelivery-sweep",
                 "vm-reaper")


@pytest.fixture
def need_engine(need_root: None, short_dir: Path) -> None:
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    baked_template(short_dir / "state")  # make_config's state_dir: the host starts only with its templates


@pytest.fixture
def closes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The order in which the host's pieces are closed (JobService.drain counted once, when it first runs)."""
    from runner.vm.engine import Engine

    seen: list[str] = []

    def spy(cls: type, method: str, name: str) -> None:
        original = getattr(cls, method)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if name not in seen:
                seen.append(name)
            return original(self, *args, **kwargs)
        monkeypatch.setattr(cls, method, wrapper)

    spy(Webhook, "close", "webhook")
    spy(JobService, "drain", "drain")
    spy(ApiServers, "close", "api")
    spy(JobService, "close", "service")
    spy(Engine, "close", "engine")
    return seen


@pytest.fixture
def webhook_settings(tmp_path: Path) -> Callable[[int], dict[str, Any]]:
    """A `webhook:` section on `port` with a redelivery sweep (GitHub App settings with a fresh key)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = tmp_path / "app.pem"
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    github = tmp_path / "github.yml"
    github.write_text(f"client_id: Iv1.test\nprivate_key_path: {pem}\norg: octo\n")
    return lambda port: {"listen": f"127.0.0.1:{port}", "secret_path": str(secret), "redeliver_every": 300,
                         "github_config": str(github)}


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def piece_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(PIECE_THREADS))


def sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor
    return count


def finish_request_workers() -> None:
    """Request workers end on their own once their connection is done (the servers do not join them)."""
    for thread in threading.enumerate():
        if thread.name.endswith("-worker"):
            thread.join(30)


def assert_nothing_left(config: ServiceConfig, threads_before: list[str], sockets_before: int) -> None:
    finish_request_workers()
    assert piece_threads() == threads_before
    assert sockets() == sockets_before
    assert not Path(config.socket).exists(), "the API's socket file is left"


def test_builds_serves_and_closes_newest_first(need_engine: None, make_config, closes: list[str],
                                               webhook_settings, tmp_path: Path) -> None:
    threads, open_sockets = piece_threads(), sockets()
    config = make_config(listen="127.0.0.1:0", token=TOKEN, webhook=webhook_settings(0))
    with ServiceHost(config, engine=EngineSettings(pool_size=0)) as host:
        assert host.engine is not None and host.service is not None and host.api is not None
        assert host.webhook is not None and host.webhook.sweep is not None
        assert JobClient(socket=config.socket).health().ok is True
        tcp = host.api.tcp_address
        assert JobClient(url=f"http://{tcp[0]}:{tcp[1]}", token=TOKEN).health().ok is True
        assert {"job-reaper", "api-unix", "api-tcp", "github-webhooks", "redelivery-sweep", "vm-reaper"} <= set(
            piece_threads())
        assert closes == []
    assert closes == ["webhook", "drain", "api", "service", "engine"]
    assert_nothing_left(config, threads, open_sockets)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(tcp, timeout=5)
    with ServiceHost(config, engine=EngineSettings(pool_size=0)):  # the engine's lock and the records are free
        pass


def test_a_failing_webhook_closes_the_api_service_and_engine(need_engine: None, make_config, closes: list[str],
                                                             webhook_settings, taken_port: int) -> None:
    threads, open_sockets = piece_threads(), sockets()
    config = make_config(listen="127.0.0.1:0", token=TOKEN, webhook=webhook_settings(taken_port))
    with pytest.raises(OSError, match="Address already in use"):
        with ServiceHost(config, engine=EngineSettings(pool_size=0)):
            pytest.fail("the host started with its webhook's port taken")
    assert closes == ["drain", "api", "service", "engine"]
    assert_nothing_left(config, threads, open_sockets)  # the redelivery sweep never started


def test_a_failing_api_closes_the_service_and_engine(need_engine: None, make_config, closes: list[str],
                                                     taken_port: int) -> None:
    threads, open_sockets = piece_threads(), sockets()
    config = make_config(listen=f"127.0.0.1:{taken_port}", token=TOKEN)
    with pytest.raises(OSError, match="Address already in use"):
        with ServiceHost(config, engine=EngineSettings(pool_size=0)):
            pytest.fail("the host started with its API's port taken")
    assert closes == ["api", "service", "drain", "engine"]  # the Unix server it had bound, then the rest
    assert_nothing_left(config, threads, open_sockets)


def test_an_engine_that_cannot_start_leaves_nothing_started(need_engine: None, make_config, closes: list[str],
                                                            short_dir: Path) -> None:
    from runner.vm.engine import Engine
    from runner.vm.statedir import StateDir

    config = make_config()
    other = Engine(StateDir(config.state_dir), pool_size=0)  # another service's engine on the same state dir
    try:
        threads, open_sockets = piece_threads(), sockets()
        with pytest.raises(SandboxError, match="the VM engine could not start on .*another microvm-check engine"):
            with ServiceHost(config, engine=EngineSettings(pool_size=0)):
                pytest.fail("two engines on one state directory")
        assert closes == []
        assert_nothing_left(config, threads, open_sockets)
        assert not config.records_path.exists(), "the job service was built above an engine that failed"
    finally:
        other.close()


def test_origin_prefixes_what_the_user_fixes_in_the_config(make_config, short_dir: Path) -> None:
    config = make_config(github_config=str(short_dir / "missing.yml"))
    with pytest.raises(ConfigError, match=r"^/etc/service\.yml: github_config: "):
        with ServiceHost(config, sandboxes=FakeSandboxes().create, origin="/etc/service.yml"):
            pass


def test_the_api_answers_while_running_jobs_get_their_grace(make_config) -> None:
    """Closing drains the service before the API: a client still reads its job's record meanwhile."""
    release = threading.Event()
    engine = FakeSandboxes(programs={"sleep": waits(release)})
    config = make_config(shutdown_grace_seconds=600)
    host = ServiceHost(config, sandboxes=engine.create).__enter__()
    closer = threading.Thread(target=host.close, name="test-closer")
    client = JobClient(socket=config.socket, timeout=30)
    try:
        job = client.submit(spec("sleep", timeout_seconds=600)).id
        client.upload_checkout(job, [checkout_tar()])
        assert next(e.data for e in client.logs(job) if e.stream == "stdout") == b"started\n"
        closer.start()
        assert host.service is not None
        for _ in range(3000):  # until the drain has begun (it stops admissions first)
            if host.service.stopping:
                break
            release.wait(0.01)
        assert host.service.stopping
        assert client.get(job).state == "running"
        with pytest.raises(JobAPIError, match="shutting down") as refused:
            client.submit(spec())
        assert refused.value.status == 503
    finally:
        release.set()
        if closer.is_alive():
            closer.join()
        else:
            host.close()
    assert engine.alive() == []
    assert not Path(config.socket).exists()


def test_engine_and_sandboxes_are_one_or_the_other(make_config) -> None:
    with pytest.raises(ValueError, match="either engine settings or a sandbox factory"):
        ServiceHost(make_config(), engine=EngineSettings(), sandboxes=FakeSandboxes().create)


def test_a_dead_services_sandbox_snapshots_are_removed_at_start(need_engine: None, make_config,
                                                                short_dir: Path) -> None:
    """No sandbox outlives its service, so their snapshot templates go before the next one serves."""
    import json

    from runner.vm.templates import TemplateStore

    baked_template(short_dir / "state", "sbx-j0123456789abcdef-1")
    baked_template(short_dir / "state", "warm-base")
    store = TemplateStore(short_dir / "state" / "templates")
    for name, extra in (("sbx-j0123456789abcdef-1", {"sandbox": "j0123456789abcdef"}),
                        ("warm-base", {"parent": {"name": "base", "digest": "d" * 20}})):
        manifest = store.dir_for(name, "d" * 20) / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "cmdline": "", "vcpus": 1, **extra}))
    with ServiceHost(make_config(), engine=EngineSettings(pool_size=0)):
        assert sorted(t.name for t in store.list()) == ["base", "warm-base"]
