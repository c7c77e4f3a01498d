"""Shared test plumbing.

Tests that need real QEMU, root or network namespaces use the `need_vm` / `need_netns` fixtures.
Outside CI a missing capability skips the test; with CI=true it fails, because CI runs real VMs and
a silent skip there would hide a broken setup.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent

# The stand-in service host's fixtures (`make_config`, `engine`, `api`, ...), for every test directory.
pytest_plugins = ("tests.fakehost",)
IN_CI = os.environ.get("CI", "").lower() == "true"

# Every property test: no per-example deadline (hypothesis' default 200 ms fails on a shared, loaded
# machine, and timings belong in bench/), and the same examples on every run (derandomize, no example
# database), so a failure reproduces and a pass means the same thing twice. Tests may raise
# max_examples or suppress more health checks; they inherit the rest from this profile.
settings.register_profile(
    "microvm-check",
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("microvm-check")


# What must not share the machine with another test file: scripts/test runs these (a file, or every file
# under a directory) in its last pass, one at a time, after the other passes. Each with what a test file
# beside it would break; a name here or in APART that no longer exists stops the collection.
ALONE: dict[str, str] = {
    "tests/test_httpserve_limits.py": "refusals within wall-clock windows of 3 to 6 s",
    "tests/service/api/test_api_slow_bodies.py": "every health answer within 3 s during a 64 MiB flood",
    "tests/vm/test_vm_memory.py": "two PSS readings of the same QEMUs within 5 MiB: another test's QEMU "
                                  "starting or ending moves their shared pages' share",
    "tests/vm/test_vm_confinement.py": "a released VM uid is free again: any VM another test starts meanwhile "
                                       "leases the lowest free uid, that one",
    "tests/vm/test_vm_cgroup_cleanup.py": "the shared parent cgroup is gone or has a child: another engine "
                                          "leaves it empty for a moment as it creates or removes its scope",
    "tests/fleet/test_fleet_walls.py": "mounts and unmounts the host's /dev/mqueue, which other fleets' "
                                       "runners cover and scan",
}

# What may share the machine with each other but not with a VM test: scripts/test's second pass, three files
# at a time (each test makes its own namespaces under a random prefix), with no VM test running.
APART: dict[str, str] = {
    "tests/net/": "reach() gives a connection 1.5 s: a VM test beside it (a VM may use vcpus+1 cores) can "
                  "starve the fake hosts' threads that long; another network test uses one core at most",
}


def _named(where: str, names: dict[str, str]) -> bool:
    return any(where == name or (name.endswith("/") and where.startswith(name)) for name in names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = [name for name in (*ALONE, *APART) if not (ROOT / name).exists()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py ALONE or APART names what does not exist: {missing}")
    for item in items:
        where = item.path.relative_to(ROOT).as_posix()
        if _named(where, ALONE):
            item.add_marker(pytest.mark.alone)
        elif _named(where, APART):
            item.add_marker(pytest.mark.apart)


FUZZ_INPUTS: dict[str, int] = {}  # the xdist workers' fuzz counts (tests/fuzz/conftest.py), summed here


def pytest_testnodedown(node: Any, error: object) -> None:
    """An xdist worker ended: add its fuzz counts to the controller's."""
    for name, count in getattr(node, "workeroutput", {}).get("fuzz_inputs", {}).items():
        FUZZ_INPUTS[name] = FUZZ_INPUTS.get(name, 0) + count


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FUZZ_INPUTS:
        counts = ", ".join(f"{name}={count}" for name, count in sorted(FUZZ_INPUTS.items()))
        terminalreporter.write_line(f"fuzz inputs: {counts} (total {sum(FUZZ_INPUTS.values())})")


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs the CLI in-process configures the root logger (`runner.logs.setup` binds a handler to
    the sys.stderr of that moment, pytest's capture file, closed after the test); put it back, so a later test
    that logs does not print "--- Logging error ---" and fail on it only because of the order tests ran in."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def require(condition: bool, why: str) -> None:
    """Skip locally, fail in CI, when a test's real dependency is missing."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"CI=true and {why}: CI must run this test for real", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def need_root() -> None:
    require(os.geteuid() == 0, "not running as root")


@pytest.fixture
def need_netns(need_root) -> None:
    require(shutil.which("ip") is not None, "iproute2 is not installed")
    require(shutil.which("iptables-restore") is not None, "iptables is not installed")
    require(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing")
