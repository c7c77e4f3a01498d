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

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent
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
