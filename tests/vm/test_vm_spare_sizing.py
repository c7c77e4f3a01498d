"""The spare pool follows demand (runner.vm.pool.Demand): the configured size is its floor, the host's memory
its cap, and a take that finds it empty while a VM is being prepared gets that VM instead of a second restore.
Fake VMs and a fake clock for the arithmetic; a threaded pool for the waiting (no timing is asserted)."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from runner.vm.pool import Demand, SpareVMs
from runner.vm.vm import VM
from tests.vm.test_vm_engine_units import WAIT_S, fake_vm, snapshot_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def arrivals(demand: Demand, clock: Clock, count: int, every_s: float) -> None:
    for _ in range(count):
        demand.arrived()
        clock.now += every_s


def test_no_demand_keeps_the_floor_and_zero_means_no_pool() -> None:
    demand = Demand(Clock())
    demand.prepared(1.0)
    assert demand.target(2, 20) == 2
    assert demand.target(0, 20) == 0


def test_a_steady_rate_sizes_the_pool_above_the_arrivals_during_one_prepare() -> None:
    clock = Clock()
    demand = Demand(clock)
    demand.prepared(1.0)
    arrivals(demand, clock, 20, 0.25)  # 4 per second, each prepare takes 1 s: 4 arrive meanwhile
    assert 4 * 0.9 < demand.rate() < 4 * 1.1
    assert demand.target(1, 20) == 4 + 4  # ceil(m + 2 sqrt(m)), m = 4
    assert demand.target(1, 5) == 5  # the memory cap wins
    assert demand.target(10, 5) == 10  # the configured floor always holds


def test_old_arrivals_stop_counting() -> None:
    clock = Clock()
    demand = Demand(clock)
    demand.prepared(1.0)
    arrivals(demand, clock, 20, 0.25)
    clock.now += Demand.WINDOW_S + 1
    assert demand.rate() == 0.0 and demand.target(2, 20) == 2


def test_prepare_time_is_a_weighted_mean() -> None:
    demand = Demand(Clock())
    demand.prepared(1.0)
    demand.prepared(2.0)
    assert demand.prepare_s is not None and abs(demand.prepare_s - 1.3) < 1e-9


def test_a_take_during_a_prepare_gets_that_vm(tmp_path: Path) -> None:
    release, preparing = threading.Event(), threading.Event()
    names = itertools.count()
    made: list[VM] = []

    def prepare(snapshot: object) -> VM:
        if made:  # the first fills the pool; the second is held until the test lets it go
            preparing.set()
            release.wait(WAIT_S)
        vm = fake_vm(tmp_path / "vms", f"vm{next(names)}")
        made.append(vm)
        return vm

    hurried: list[object] = []
    pool = SpareVMs(prepare, size=1, hurry=hurried.append)
    snapshot = snapshot_of(tmp_path, "d1")
    pool.refill(snapshot)
    first = None
    for _ in range(int(WAIT_S * 100)):
        if (first := pool.take(snapshot)) is not None:
            break
        threading.Event().wait(0.01)
    assert first is made[0]
    demand = pool._demand[snapshot]
    demand.prepare_s, demand.miss_s = WAIT_S, 2 * WAIT_S  # the VM being prepared is due before a restore of its own
    pool.refill(snapshot)
    # the filler thread is under way (a loaded machine may start it late): a take before it begins has no
    # VM in preparation to wait for, and rightly restores its own
    assert preparing.wait(WAIT_S), "the pool never began preparing the second VM"
    taken: list[VM | None] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take(snapshot)))
    taker.start()
    for _ in range(int(WAIT_S * 100)):  # the taker is waiting on the pool (not restoring) before the VM is done
        if pool._changed._waiters:  # type: ignore[attr-defined]
            break
        threading.Event().wait(0.01)
    assert pool._changed._waiters, "the take did not wait for the VM in preparation"  # type: ignore[attr-defined]
    assert hurried == [snapshot], "the engine is told to give the VM being prepared a job's CPU share"
    assert pool.take(snapshot) is None, "a second take waits for no VM: only one is being prepared"
    release.set()
    taker.join(WAIT_S)
    assert taken and taken[0] is made[1], "the take restored nothing itself and got the VM being prepared"
    pool.close()


def test_a_take_with_nothing_in_preparation_returns_at_once(tmp_path: Path) -> None:
    pool = SpareVMs(lambda snapshot: fake_vm(tmp_path / "vms", "never"), size=0)
    assert pool.take(snapshot_of(tmp_path, "d1")) is None
    assert pool.target(snapshot_of(tmp_path, "d1")) == 0
    assert pool.misses == 0  # counted when the taker reports its own restore (bench/job.py prints them)
    pool.missed(snapshot_of(tmp_path, "d1"), 0.4)
    assert pool.misses == 1
    pool.close()


def test_a_take_does_not_wait_for_a_prepare_slower_than_its_own_restore() -> None:
    clock = Clock()
    demand = Demand(clock)
    demand.prepared(2.0)  # a pooled VM: restore, first answers, checkout rehearsal
    demand.missed(0.5)  # a taker's own restore
    assert demand.worth_waiting() == 0.0  # nothing is being prepared
    demand.preparing_since = clock.now
    assert demand.worth_waiting() == 0.0  # 2 s left: restoring its own is sooner
    clock.now += 1.8
    assert abs(demand.worth_waiting() - 0.2) < 1e-9  # 0.2 s left: waiting is sooner
    clock.now += 0.5
    assert demand.worth_waiting() == 0.0  # overdue: no estimate left, restore
