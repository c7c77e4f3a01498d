"""Engine and VM bookkeeping with fake machines: no QEMU needed."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from runner.vm.engine import Engine
from runner.vm.statedir import StateDir
from runner.vm.vm import VM


class FakeMachine:
    def __init__(self) -> None:
        self.running = True

    def alive(self) -> bool:
        return self.running

    def kill(self) -> None:
        self.running = False

    def exit_status(self):
        return None if self.running else -9

WAIT_S = 60.0  # a bound on waiting for the reaper or a filler thread, generous for a loaded machine: not a timing


class SlotsThatFail:
    def release(self, slot) -> None:
        raise RuntimeError("the slot could not be released")


release_that_fails = SlotsThatFail()


def fake_vm(tmp_path, name: str, release=None) -> VM:
    vm_dir = tmp_path / name
    vm_dir.mkdir(parents=True)
    (vm_dir / "disk.qcow2").write_bytes(b"overlay")
    return VM(id=name, dir=vm_dir, machine=FakeMachine(), snapshot=None, slot=object() if release else None, slots=release)


def test_the_vm_directory_goes_even_when_releasing_the_slot_fails(tmp_path):
    vm = fake_vm(tmp_path, "a", release_that_fails)
    with pytest.raises(RuntimeError, match="could not be released"):
        vm.destroy()
    assert not vm.dir.exists()
    assert vm.destroyed


class SlowToDie(FakeMachine):
    """A VMM whose kill waits until the test lets it go: a destroy caught half way."""

    def __init__(self) -> None:
        super().__init__()
        self.killing, self.let_go = threading.Event(), threading.Event()

    def kill(self) -> None:
        self.killing.set()
        assert self.let_go.wait(WAIT_S)
        super().kill()


def test_a_destroy_that_finds_another_under_way_returns_only_once_the_vm_is_gone(tmp_path):
    """The agent channel's reader (or the reaper) ends a VM whose VMM died while the job's thread ends it
    too: the second destroy used to return at once, and its caller freed the engine and its directory with
    the VM's files still there (the seccomp test left its VM's directory behind, 1 run in 20)."""
    vm = fake_vm(tmp_path, "a")
    vm.machine = machine = SlowToDie()
    first = threading.Thread(target=vm.destroy)
    first.start()
    assert machine.killing.wait(WAIT_S)
    second_done = threading.Event()
    second = threading.Thread(target=lambda: (vm.destroy(), second_done.set()))
    second.start()
    assert not second_done.wait(0.2), "a second destroy returned while the first was still ending the VM"
    assert vm.destroyed and vm.dir.exists()
    machine.let_go.set()
    first.join(WAIT_S)
    assert second_done.wait(WAIT_S)
    assert not vm.dir.exists()
    second.join(WAIT_S)


def test_the_reaper_survives_a_vm_that_fails_to_end(tmp_path):
    engine = Engine(StateDir(tmp_path / "state"), hypervisor=object(), pool_size=0)
    try:
        vms = [fake_vm(engine.state.vms, "bad", release_that_fails), fake_vm(engine.state.vms, "good")]
        for vm in vms:
            vm.expires_at = 0.0
            engine._vms[vm.id] = vm
        deadline = time.monotonic() + WAIT_S
        while engine.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.live() == []
        assert all(vm.destroyed and not vm.dir.exists() for vm in vms)
        late = fake_vm(engine.state.vms, "late")
        late.expires_at = 0.0
        engine._vms[late.id] = late
        deadline = time.monotonic() + WAIT_S
        while engine.live() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.live() == [] and late.destroyed, "the reaper thread died"
        assert engine._reaper.is_alive()
    finally:
        engine.close()


def snapshot_of(root, digest: str, variant: str = "nonet"):
    from runner.vm.hypervisor import MachineConfig, Snapshot

    vdir = root / "base" / digest / variant
    config = MachineConfig(vdir / "vmlinuz", vdir / "initrd.img", "", 512, 1, variant == "net", "tcg")
    return Snapshot(config=config, mem_file=vdir / "mem.ram", state_file=vdir / "state.bin", disk=vdir / "disk.img")


def test_a_rebuilt_template_evicts_vms_pooled_for_the_old_build(tmp_path):
    from runner.vm.pool import SpareVMs

    made: list[VM] = []
    names = itertools.count()

    def prepare(snapshot) -> VM:
        vm = fake_vm(tmp_path / "vms", f"vm{next(names)}")
        made.append(vm)
        return vm

    pool = SpareVMs(prepare, size=1)
    old, other_variant, new = snapshot_of(tmp_path, "d1"), snapshot_of(tmp_path, "d1", "net"), snapshot_of(tmp_path, "d2")
    for snapshot in (old, other_variant):
        pool.refill(snapshot)
    deadline = time.monotonic() + WAIT_S
    while (len(made) < 2 or pool._filling) and time.monotonic() < deadline:
        time.sleep(0.01)
    (stale,), (kept,) = pool._ready[old], pool._ready[other_variant]
    pool.refill(new)
    assert stale.destroyed and not kept.destroyed
    assert pool.take(old) is None
    assert pool.take(other_variant) is kept
    pool.close()


def test_the_vmm_spawned_ahead_is_one_per_snapshot_whatever_the_demand(tmp_path):
    """The spare pool grows with arrivals x prepare time; the standby VMM does not (it is replaced one for one)."""
    engine = Engine(StateDir(tmp_path / "state"), hypervisor=object(), pool_size=1)
    try:
        snapshot = snapshot_of(tmp_path, "d1")
        for pool in (engine.pool, engine._standby):
            pool._demand[snapshot].prepared(5.0)  # slow prepares: a loaded host
            for _ in range(4):
                assert pool.take(snapshot) is None  # four arrivals within moments, nothing ready
        assert engine.pool.target(snapshot) > 1, "the spare pool no longer follows demand: this test shows nothing"
        assert engine._standby.target(snapshot) == 1
    finally:
        engine.close()


def test_a_sandbox_snapshot_is_a_leftover_unless_another_live_state_directory_made_it(tmp_path):
    """At start-up a service removes the sandbox snapshots its ended predecessor left; a template store shared
    with another engine on a state directory of its own (`localrun` beside `serve`) holds that one's too."""
    from runner.vm.templates import Template

    engine = Engine(StateDir(tmp_path / "state"), hypervisor=object(), pool_size=0)
    other = tmp_path / "other-state"
    other.mkdir()
    try:
        def made_in(where: object) -> Template:
            manifest = {"sandbox": "j0123456789abcdef"} | ({} if where is None else {"made_in": str(where)})
            return Template(name="sbx-j0123456789abcdef-1", digest="d" * 20, path=tmp_path, manifest=manifest)

        assert engine.is_leftover(made_in(engine.state.root.resolve())), "its own predecessor's"
        assert engine.is_leftover(made_in(tmp_path / "gone")), "a state directory that is gone comes back to no one"
        assert engine.is_leftover(made_in(None)), "made before the maker was recorded"
        assert not engine.is_leftover(made_in(other)), "another engine's, which may be using it"
    finally:
        engine.close()
