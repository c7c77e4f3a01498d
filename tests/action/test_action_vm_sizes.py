"""Size classes end to end: the action's `size:` input, the service config's `sizes:`, the repository's
allowance in the operator's store, the template baked at that size (base.large, scripts/setup --test),
and the VM's cgroup limits, on real VMs. A size the repository's store file does not list is refused
before any VM is spent, with an error that says what to change.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.action.action_harness import FORK_PR, Simulation, finish, run_action, start
from tests.action.test_action_vm_e2e import _host
from tests.conftest import ROOT, require
from tests.reference import captured

pytestmark = pytest.mark.vm

SIZES = ROOT / "tests" / "fixtures" / "sizes.yml"  # large: 2 vCPUs, 1024 MiB (what base.large is baked at)
REPOSITORY = ("listendev", "lstn")  # FORK_PR's base repository


@pytest.fixture(scope="module")
def large_template() -> None:
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateNotFound, TemplateStore

    try:
        TemplateStore(StateDir.default().templates).get("base.large")
    except TemplateNotFound as exc:
        require(False, f"{exc} (with --size large --config {SIZES})")


@pytest.fixture
def service(large_template: None, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    """A service offering the tests' sizes, whose store file for the repository is `request.param`."""
    import yaml

    owner, repo = REPOSITORY
    (tmp_path / "store" / owner).mkdir(parents=True)
    (tmp_path / "store" / owner / f"{repo}.yml").write_text(request.param)
    sizes = yaml.safe_load(SIZES.read_text())["sizes"]
    yield from _host({"sizes": sizes, "policy_dir": str(tmp_path / "store")})


@pytest.fixture
def sim(tmp_path: Path) -> Simulation:
    (tmp_path / "workspace").mkdir()
    (tmp_path / "runner-temp").mkdir()
    return Simulation(tmp_path / "workspace", tmp_path / "runner-temp", captured(FORK_PR))


def vm_limits(state_dir: Path, seen: dict[str, str], stop: threading.Event) -> None:
    """Read the job VM's cgroup limits on the host while it lives (its group exists from spawn to destroy)."""
    from runner.vm import cgroup

    scope = cgroup.scope_for(state_dir / "vms")
    while not stop.is_set() and not seen:
        for group in cgroup.groups(scope):
            for name in ("memory.max", "cpu.max", "memory.limit_in_bytes", "cpu.cfs_quota_us"):
                try:
                    seen[name] = (group / name).read_text().strip()
                except OSError:
                    continue
        time.sleep(0.05)


@pytest.mark.parametrize("service", ["version: 1\nsizes: [large]\n"], indirect=True)
def test_an_allowed_size_gets_its_vcpus_memory_and_cgroup_limits(service, sim) -> None:
    from runner.vm.cgroup import limits_for

    seen: dict[str, str] = {}
    stop = threading.Event()
    poller = threading.Thread(target=vm_limits, args=(service.config.state_dir, seen, stop))
    poller.start()
    try:
        metadata, steps = start(sim, {"size": "large", "socket": service.config.socket, "timeout-minutes": "5",
                                      "run": "echo nproc=$(nproc); grep MemTotal /proc/meminfo; sleep 15"})
        result = finish(sim, metadata, steps)
    finally:
        stop.set()
        poller.join()
    assert result.returncode == 0, result.log
    assert "nproc=2" in result.log, result.log
    mem_kib = int(next(line.split()[1] for line in result.log.splitlines() if line.startswith("MemTotal:")))
    assert 900 * 1024 < mem_kib <= 1024 * 1024, mem_kib  # 1024 MiB less what the kernel keeps for itself
    want = limits_for(2, 1024)
    quota = str(int(want.cpus * 100_000))
    assert seen.get("memory.max", seen.get("memory.limit_in_bytes")) == str(want.memory_bytes), seen
    assert seen.get("cpu.max", seen.get("cpu.cfs_quota_us", "")).split()[0] == quota, seen


@pytest.mark.parametrize("service", ["version: 1\n"], indirect=True)
def test_a_size_the_repository_may_not_use_is_refused_with_what_to_do(service, sim) -> None:
    result = run_action(sim, {"size": "large", "socket": service.config.socket, "run": "true"})
    assert result.returncode != 0
    assert "may not use the size 'large'" in result.log and "sizes: [large]" in result.log, result.log
    unknown = run_action(sim, {"size": "huge", "socket": service.config.socket, "run": "true"})
    assert unknown.returncode != 0 and "'huge' is not offered here" in unknown.log, unknown.log
