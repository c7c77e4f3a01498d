"""The real-VM service tests' fixtures (the built templates, a private engine root, started hosts on real
VMs), and submitting a job and reading its output through the API.

They use the typed client of the job API's contract (runner.jobapi), as the action does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from runner.jobapi.client import JobClient
from runner.net import NamespaceUplink, Upstream
from runner.service.config.reading import config_from_mapping
from runner.service.jobs.service import JobService
from tests.conftest import require
from tests.net import net_fakes
from tests.service.service_fakes import checkout_tar, spec


def submit(client: JobClient, command: str, files: dict[str, bytes] | None = None, **fields: Any) -> str:
    """Submit `command` with a checkout of `files` (default: a README); the job's id."""
    job = client.submit(spec(command, **fields)).id
    client.upload_checkout(job, checkout_tar(files))
    return job


def output(client: JobClient, job: str) -> bytes:
    """The job's stdout and stderr, once its log has ended (so once the job has)."""
    return b"".join(e.data for e in client.logs(job) if e.stream in ("stdout", "stderr"))


@pytest.fixture(scope="module")
def templates() -> Path:
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateNotFound, TemplateStore

    path = StateDir.default().templates
    try:
        TemplateStore(path).get("base")
    except TemplateNotFound as exc:
        require(False, str(exc))
    return path


@pytest.fixture
def vm_root(templates: Path) -> Iterator[Path]:
    """A private engine root whose templates are the built ones (read only)."""
    root = Path(tempfile.mkdtemp(prefix="mvc-svc-vm-", dir="/tmp"))
    (root / "state").mkdir()
    os.symlink(templates, root / "state" / "templates")
    yield root
    assert_no_leftovers(root / "state")
    shutil.rmtree(root, ignore_errors=True)


def assert_no_leftovers(state: Path) -> None:
    from runner.vm.engine import LOCK_NAME
    from runner.vm.sweep import processes_under

    vms = state / "vms"
    if vms.exists():
        assert processes_under(vms) == [], "QEMU processes left running"
        assert [p.name for p in vms.iterdir() if p.name != LOCK_NAME] == [], "VM directories left behind"
    jobs = state / "jobs"
    if jobs.exists():
        for job in jobs.iterdir():
            assert not (job / "checkout.tar").exists(), f"{job.name}: checkout spool left behind"


@pytest.fixture
def vm_host(vm_root: Path) -> Iterator[Callable[..., Any]]:
    """Started `ServiceHost`s on real VMs; at teardown a job's VM that outlived the service fails the test."""
    from runner.service.host.assembly import EngineSettings, ServiceHost

    made: list[ServiceHost] = []

    def make(**settings: Any) -> ServiceHost:
        config = config_from_mapping({"socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"),
                                      "shutdown_grace_seconds": 0, **settings})
        host = ServiceHost(config, engine=EngineSettings(pool_size=1)).__enter__()
        made.append(host)
        return host

    yield make
    for host in made:
        assert host.service is not None and host.engine is not None
        try:
            host.service.drain()
            assert host.engine.live() == [], "a job's VM outlived the service"
        finally:
            host.close()


@pytest.fixture
def vm_service(vm_host: Callable[..., Any]) -> Callable[..., tuple[JobService, JobClient]]:
    def make(**settings: Any) -> tuple[JobService, JobClient]:
        host = vm_host(**settings)
        return host.service, JobClient(socket=host.config.socket)
    return make


def bound_service(stack: ExitStack, vm_root: Path, directory: Path, internet: str, prefix: str, ca_file: Path, *,
                  policy: str, bindings: str, value_file: str, value: str, **settings: Any) -> Callable[[], Any]:
    """The secret-binding tests' service, as an operator sets it up: `policy` in the store for octo/hello and
    octo/other, the `bindings` file (bindings.yml in `directory`) and the root-only `value_file` it names
    holding `value`; jobs get slots `prefix` on the fake internet `internet`, trusting its TLS servers' CA
    (`ca_file`). Returns a maker of started `ServiceHost`s (other config `settings` added), closed with `stack`."""
    from runner.service.host.assembly import EngineSettings, ServiceHost

    store = directory / "policies"
    (store / "octo").mkdir(parents=True)
    for repository in ("hello", "other"):
        (store / "octo" / f"{repository}.yml").write_text(policy)
    (directory / value_file).write_text(value + "\n")
    (directory / value_file).chmod(0o600)
    (directory / "bindings.yml").write_text(bindings)

    def make() -> ServiceHost:
        config = config_from_mapping({
            "socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"), "shutdown_grace_seconds": 0,
            "policy_dir": str(store), "secrets": str(directory / "bindings.yml"),
            "network": {"enabled": True, "slot_prefix": prefix, "upstream_ca": str(ca_file)}, **settings},
            base=directory)
        engine = EngineSettings(uplink=NamespaceUplink(internet), pool_size=0,
                                upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=internet))
        return stack.enter_context(ServiceHost(config, engine=engine))

    return make
