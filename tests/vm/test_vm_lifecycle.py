"""VM lifecycle across crashes: what a killed predecessor leaves is swept at the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from runner.state import StateDir
from runner.vm.errors import VMError
from runner.vm.sweep import processes_under
from tests.vm.conftest import assert_no_leftovers

CRASHING_SERVICE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from runner.state import StateDir
    from runner.sandbox import Sandbox
    from runner.vm.engine import Engine
    from vmimages.store import TemplateStore
    engine = Engine(StateDir(Path(sys.argv[1])), templates=TemplateStore(StateDir.default().templates), pool_size=1)
    sbx = Sandbox.create(engine=engine)
    print("ready", flush=True)
    sbx.exec("sleep 600")
    """
)


def test_start_up_sweeps_what_a_killed_predecessor_left(template_store, tmp_path, make_engine):
    state = StateDir(tmp_path / "state")
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_SERVICE, str(state.root)],
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        assert child.stdout.readline().strip() == b"ready"
        assert processes_under(state.vms), "the child should have a running VM"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    orphans = processes_under(state.vms)
    assert orphans, "QEMU runs in its own session, so it outlives a killed service"
    engine = make_engine()  # same state directory: the new engine sweeps at start
    assert engine.state == state
    engine.shutdown()
    assert_no_leftovers(state)


def test_one_engine_per_state_directory(make_engine):
    make_engine()
    with pytest.raises(VMError, match="another microvm-check engine"):
        make_engine()
