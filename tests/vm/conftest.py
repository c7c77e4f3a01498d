"""Fixtures for tests on real VMs: an engine with a private VM directory and the built template.

Every test gets its own engine; at teardown the engine is closed and the test fails if
anything of it is left: a VMM process, an overlay, a socket or a VM directory.
"""

from __future__ import annotations

import os
import shutil

import pytest

from runner.vm.statedir import StateDir
from tests.conftest import require


@pytest.fixture(scope="session")
def template_store():
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    from runner.vm.templates import TemplateNotFound, TemplateStore

    store = TemplateStore(StateDir.default().templates)
    try:
        store.get("base")
    except TemplateNotFound as exc:
        require(False, f"{exc}")
    return store


def require_template(store, name: str) -> None:
    """Skip locally, fail in CI, when the template `name` is not built (scripts/setup --test builds them)."""
    from runner.vm.templates import TemplateNotFound

    try:
        store.get(name)
    except TemplateNotFound as exc:
        require(False, f"{exc}")


def assert_no_leftovers(state: StateDir) -> None:
    from runner.vm import cgroup
    from runner.vm.engine import LOCK_NAME
    from runner.vm.sweep import processes_under

    assert processes_under(state.vms) == [], "VMM processes left running"
    left = [p.name for p in state.vms.iterdir() if p.name != LOCK_NAME]
    assert left == [], f"VM directories left behind: {[(n, sorted(os.listdir(state.vms / n))) for n in left]}"
    groups = cgroup.groups(cgroup.scope_for(state.vms))
    assert groups == [], f"VM cgroups left behind: {groups}"
    scope = [p for p in cgroup.scope_paths(cgroup.scope_for(state.vms)) if p.exists()]
    assert scope == [], f"the engine's own cgroup directories left behind: {scope}"


@pytest.fixture
def make_engine(template_store, tmp_path):
    """A factory, so a test can also close its engine itself (or build a second one)."""
    from runner.vm.engine import Engine

    engines = []

    def make(pool_size: int = 1, **kwargs) -> Engine:
        engine = Engine(StateDir(tmp_path / "state"), templates=template_store, pool_size=pool_size, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
    if engines:
        assert_no_leftovers(engines[0].state)


@pytest.fixture
def engine(make_engine):
    return make_engine()


@pytest.fixture
def sandbox(engine):
    from runner.sandbox import Sandbox

    with Sandbox.create(engine=engine) as sbx:
        yield sbx
