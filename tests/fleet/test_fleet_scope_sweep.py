"""A service that died with runners running: its successor's start-up sweep kills them and removes their
cgroups, even when its config starts no fleet; a live service's runners in a scope it holds are left alone
(runner/fleet/scope.py).

Each "service" here is a child process that does what a fleet does at its start and for a runner: it takes
the scope's claim (ScopeClaim.take, in its state directory) and puts a runner's process, in a session of its
own as a daemonizing job would be, into a runner cgroup of that scope. A dead one is SIGKILLed: the kernel
drops its lock, its claim file and its runner's process stay. The successor is the real ServiceHost.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.fleet import cgroup
from runner.fleet.scope import CLAIM_FILE, sweep_stale
from runner.service.config.reading import config_from_mapping
from runner.service.host.assembly import ServiceHost
from tests.conftest import require
from tests.procs import runs, wait_gone

CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from runner.fleet.cgroup import RunnerCgroup
    from runner.fleet.scope import ScopeClaim
    state, scope = Path(sys.argv[1]), sys.argv[2]
    claim = ScopeClaim.take(state, scope)
    group = RunnerCgroup.create(scope, "mvc-test-runner-1")
    job = subprocess.Popen(["sleep", "600"], start_new_session=True)
    group.add(job.pid)
    print(job.pid, flush=True)
    time.sleep(600)
""")


class FakeService:
    """A service's stand-in holding a runner scope: its child process, and its runner's process."""

    def __init__(self, state: Path, scope: str) -> None:
        state.mkdir(parents=True, exist_ok=True)
        self.state, self.scope = state, scope
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(state), scope], stdout=subprocess.PIPE,
                                     cwd=Path(__file__).resolve().parents[2])
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip().isdigit(), f"the stand-in service did not start its runner: {line!r}"
        self.runner_pid = int(line)

    def die(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _no_vms(request: object) -> object:
    raise AssertionError("no job runs here: no VM may be created")


@pytest.fixture
def root(need_root: None) -> Iterator[Path]:
    try:
        cgroup._pids_root()
    except cgroup.CgroupError as exc:
        require(False, f"runner cgroups need the pids controller: {exc}")
    path = Path(tempfile.mkdtemp(prefix="mvc-scope-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_start_up_sweeps_a_dead_services_runners_and_leaves_a_live_ones(root: Path) -> None:
    dead_scope = cgroup.scope_for(root / "dead-runners")
    live_scope = cgroup.scope_for(root / "live-runners")
    dead = FakeService(root / "state", dead_scope)
    live = FakeService(root / "other-state", live_scope)
    try:
        dead.die()
        assert runs(dead.runner_pid), "the dead service's runner lives on (what the sweep is for)"
        assert (root / "state" / CLAIM_FILE).exists()
        # A third state directory whose claim names the live service's scope (it used that runners_dir before).
        (root / "third").mkdir()
        (root / "third" / CLAIM_FILE).write_text(f'{{"scope": "{live_scope}"}}')

        for state in ("state", "third"):
            config = config_from_mapping({"socket": str(root / state / "api.sock"), "state_dir": str(root / state),
                                          "templates": ["base"]})
            with ServiceHost(config, sandboxes=_no_vms, serve_api=False):  # no runners: section: no fleet
                pass

        assert not wait_gone([dead.runner_pid], 10.0), "the dead service's runner was not killed"
        assert not cgroup.scope_exists(dead_scope), "the dead service's runner cgroups were not removed"
        assert not (root / "state" / CLAIM_FILE).exists()
        assert runs(live.runner_pid), "a live service's runner was killed"
        assert cgroup.scope_exists(live_scope)
        assert not (root / "third" / CLAIM_FILE).exists(), "a claim on a scope another service holds is forgotten"
    finally:
        for service in (dead, live):
            service.die()
        sweep_stale(live.state)  # the live one's leftovers, as its own successor would sweep them
        sweep_stale(dead.state)
        for pid in (dead.runner_pid, live.runner_pid):
            if runs(pid):
                os.kill(pid, signal.SIGKILL)
    assert not cgroup.scope_exists(live_scope)
