"""A template being removed is forgotten by the spare pools (issue 40): the VM a filler is preparing for it
when it is forgotten is ended, not added, and nothing is prepared for it again. Before, the pools were only
emptied once: the refill in flight added its VM afterwards and refills kept starting, so every fork and
destroy of a sandbox left a VM running on the removed snapshot's files, counted in no limit.

The pool with fake VMs for the order of events; the engine on real VMs for the whole path."""

from __future__ import annotations

import threading
import time

from runner.vm.pool import SpareVMs
from runner.vm.sweep import processes_under
from runner.vm.vm import VM
from tests.vm.test_vm_engine_units import WAIT_S, fake_vm, snapshot_of


def test_the_vm_a_filler_prepares_for_a_forgotten_snapshot_is_discarded(tmp_path) -> None:
    snapshot = snapshot_of(tmp_path, "d1")
    snapshot.state_file.parent.mkdir(parents=True)  # its files are still there: forget comes before removal
    preparing, cancelled = threading.Event(), threading.Event()
    made: list[VM] = []

    def prepare(_snapshot: object) -> VM:
        preparing.set()
        cancelled.wait(WAIT_S)  # a prepare that outlasts the forget's start
        made.append(fake_vm(tmp_path / "vms", f"vm{len(made)}"))
        return made[-1]

    pool = SpareVMs(prepare, size=1, cancel=lambda _snapshot: cancelled.set())
    pool.refill(snapshot)
    assert preparing.wait(WAIT_S), "the filler never began"
    handed = pool.forget(snapshot)  # returns once the filler is done: nothing of it outlives the call
    assert cancelled.is_set(), "the VM being prepared was not cancelled"
    assert len(made) == 1 and made[0].destroyed, "the VM prepared for the forgotten snapshot was not ended"
    assert handed == [] and pool.ready() == {}, "the VM prepared for the forgotten snapshot was kept"
    pool.refill(snapshot)
    assert pool.idle(snapshot) and len(made) == 1, "a refill started for a forgotten snapshot"
    assert pool.take(snapshot) is None
    pool.close()


def test_forgetting_a_template_ends_the_spare_being_restored_and_refills_none(make_engine) -> None:
    """The whole path on real VMs: the engine's filler is restoring a spare of `base` when `base` is
    forgotten. That VM is ended, so are the VMMs spawned ahead, the RAM copy kept for its restores is
    dropped, and no refill starts again."""
    engine = make_engine(pool_size=1)
    snapshot = engine.template("base").snapshot(False)
    engine.pool.refill(snapshot)
    deadline = time.monotonic() + WAIT_S
    while (restoring := engine._preparing.get(snapshot)) is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert restoring is not None, "the filler never began a restore"
    engine.forget_template("base")
    assert restoring.destroyed and not restoring.machine.alive(), "the spare being restored still runs"
    assert engine.pool.ready() == {} and engine.standby_vmms() == 0
    assert snapshot.mem_file not in engine.hv._ram, "the template's RAM copy is kept for restores no one asks for"
    for pool in (engine.pool, engine._standby):
        pool.refill(snapshot)
        assert pool.idle(snapshot), "a refill started for a forgotten template"
    assert processes_under(engine.state.vms) == [], "a VMM of the forgotten template still runs"
