"""VM lifecycle across crashes: a killed service takes its VMs with it, and what it leaves on disk
or in cgroups is swept at the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from runner.vm import cgroup
from runner.vm.errors import VMError
from runner.vm.statedir import StateDir
from runner.vm.sweep import processes_under
from tests.procs import wait_gone
from tests.vm.conftest import assert_no_leftovers

CRASHING_SERVICE = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    from runner.sandbox import Sandbox
    from runner.vm.engine import Engine
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore
    engine = Engine(StateDir(Path(sys.argv[1])), templates=TemplateStore(StateDir.default().templates), pool_size=2)
    sbx = Sandbox.create(engine=engine)
    # The pool refills from a thread of its own that ends when it is done: its VMs must not die with it.
    # So does the VMM spawned ahead for the next restore.
    while (any(t.name == "pool-fill" for t in threading.enumerate()) or sum(map(len, engine.pool._ready.values())) < 2
           or engine.standby_vmms() < 1):
        time.sleep(0.1)
    print("ready", flush=True)
    sbx.exec("sleep 600")
    """
)
GONE_TIMEOUT_S = 60.0  # generous: the machine is shared; what matters is that they go


def test_vms_die_with_a_killed_service_and_its_leftovers_are_swept(template_store, tmp_path, make_engine):
    state = StateDir(tmp_path / "state")
    child = subprocess.Popen(
        [sys.executable, "-c", CRASHING_SERVICE, str(state.root)],
        stdout=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        assert child.stdout.readline().strip() == b"ready"
        vmms = processes_under(state.vms)
        assert len(vmms) == 4, f"the child should have a VM running a job, two pooled, one spawned ahead: {vmms}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert wait_gone(vmms, GONE_TIMEOUT_S) == [], "QEMU processes outlived the service that supervised them"
    assert cgroup.groups(cgroup.scope_for(state.vms)), "the killed service leaves its VMs' (now empty) cgroups"
    engine = make_engine()  # same state directory: the new engine sweeps at start
    assert engine.state == state
    engine.close()
    assert_no_leftovers(state)


def test_one_engine_per_state_directory(make_engine):
    make_engine()
    with pytest.raises(VMError, match="another microvm-check engine"):
        make_engine()
