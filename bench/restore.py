"""Restore benchmark: how fast a job gets a ready VM, what one costs, and how fast it goes away.

Run as root on a host with the template built:  .venv/bin/python bench/restore.py [--samples N]
Prints the details, then as its last line one JSON object with the numbers the VM engine issue
asks for. Every ratio is computed from numbers measured in this same run. `--smoke` (the test
suite's run, tests/test_bench_smoke.py): every measurement once or twice, with 2 VMs for PSS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile as pct
from runner.sandbox import Sandbox
from runner.vm.agent import AgentClient
from runner.vm.engine import Engine
from runner.vm.hypervisor import Launch
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateStore


def summary(name: str, values: list[float]) -> None:
    print(f"{name:<28} n={len(values):<3} p50={pct(values, 0.5):8.1f}  p99={pct(values, 0.99):8.1f}  "
          f"min={min(values):8.1f}  max={max(values):8.1f}  (ms)")


def wait_for(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up in time")
        time.sleep(0.05)


def wait_for_pool(engine: Engine, snapshot, size: int) -> None:
    """Idle: the spares and the VMM spawned ahead are up, and no filler is at work (the pool follows demand,
    so it may be preparing one more than `size`: a restore beside the claim made a pooled ready p50 of
    101 ms instead of 20, alternated in one run on a loaded host)."""
    def idle() -> bool:
        with engine.pool._lock:
            ready = len(engine.pool._ready[snapshot])
        return (ready >= size and engine.standby_vmms() >= 1 and engine.pool.idle(snapshot)
                and engine._standby.idle(snapshot))
    wait_for(idle, "the warm pool")


def ready_and_teardown(engine: Engine, samples: int) -> tuple[list[float], list[float]]:
    snapshot = engine.template("base").snapshot(False)
    ready, teardown = [], []
    engine.pool.refill(snapshot)
    for _ in range(samples):
        wait_for_pool(engine, snapshot, engine.pool.size)
        sbx = Sandbox.create(engine=engine)
        ready.append(sbx.ready_ms)
        t = time.monotonic()
        sbx.destroy()
        teardown.append((time.monotonic() - t) * 1000)
    return ready, teardown


def unpooled_restore(engine: Engine, samples: int, ahead: bool = True) -> list[float]:
    """Spawn + restore + first agent answer, no spare VM: what a pool miss costs. `ahead`: the engine's
    VMM spawned ahead (jail, cgroup, descriptors, QEMU started) is used, and replaced after each restore,
    with a job's gap (0.5 s) between samples; otherwise every VMM is spawned on the clock."""
    snapshot = engine.template("base").snapshot(False)
    out = []
    for _ in range(samples):
        if ahead:
            engine._standby.refill(snapshot)
            wait_for(lambda: engine.standby_vmms() >= 1 and engine._standby.idle(snapshot), "the VMM spawned ahead")
            time.sleep(0.5)
        else:
            for spare in engine._standby.drain(snapshot):
                spare.destroy()
        t = time.monotonic()
        vm = engine._spawn(snapshot)
        try:
            vm.machine.restore(snapshot)
            vm.agent = AgentClient(vm.machine.agent)
            vm.machine.resume()
            vm.agent.ping(timeout=60)
            out.append((time.monotonic() - t) * 1000)
        finally:
            vm.destroy()
    return out


def cold_boot(engine: Engine, samples: int) -> list[float]:
    """Kernel to agent answer, as a job would wait without snapshots."""
    snapshot = engine.template("base").snapshot(False)
    out = []
    for _ in range(samples):
        with tempfile.TemporaryDirectory(prefix="mvc-cold-") as tmp:
            tmpdir = Path(tmp)
            disk = engine.hv.overlay(snapshot.disk, tmpdir)
            launch = Launch(vm_dir=tmpdir, disk=disk.path, disk_format=disk.format)
            t = time.monotonic()
            machine = engine.hv.boot(snapshot.config, tmpdir / "mem.ram", launch)
            agent = AgentClient(machine.agent)
            try:
                agent.ping(timeout=300)
                out.append((time.monotonic() - t) * 1000)
            finally:
                agent.close()
                machine.kill()
    return out


def pss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss line")


def pss_per_vm(engine: Engine, count: int) -> float:
    boxes = [Sandbox.create(engine=engine) for _ in range(count)]
    try:
        time.sleep(2.0)  # idle
        pids = [vm.machine.pid for vm in engine.live()]
        return sum(pss_mib(pid) for pid in pids) / len(pids)
    finally:
        for sbx in boxes:
            sbx.destroy()


def creates_per_second(engine: Engine, threads: int, per_thread: int) -> float:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(per_thread):
                Sandbox.create(engine=engine).destroy()
        except BaseException as exc:  # reported below, never swallowed
            errors.append(exc)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    t = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - t
    if errors:
        raise errors[0]
    return threads * per_thread / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--cold-samples", type=int, default=2)
    parser.add_argument("--pss-vms", type=int, default=8, help="idle VMs up while PSS is read (default 8)")
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    args = parser.parse_args()
    if args.smoke:
        args.samples, args.cold_samples, args.pss_vms = 2, 1, 2
    templates = TemplateStore(StateDir.default().templates)
    with tempfile.TemporaryDirectory(prefix="mvc-bench-") as tmp:
        engine = Engine(StateDir(Path(tmp) / "pooled"), templates=templates, pool_size=2)
        try:
            print(f"accelerator: {engine.template('base').manifest['accel']} "
                  f"({engine.template('base').manifest['accel_reason']})")
            ready, teardown = ready_and_teardown(engine, args.samples)
            summary("ready (warm pool)", ready)
            summary("teardown", teardown)
            unpooled_n = 2 if args.smoke else max(5, args.samples // 4)
            unpooled, fresh = [], []
            for _ in range(unpooled_n):  # alternated, so both see the same machine
                unpooled += unpooled_restore(engine, 1, ahead=True)
                fresh += unpooled_restore(engine, 1, ahead=False)
            summary("restore, no pool", unpooled)
            summary("restore, nothing ahead", fresh)
            cold = cold_boot(engine, args.cold_samples)
            summary("cold boot", cold)
            pss = pss_per_vm(engine, args.pss_vms)
            print(f"PSS per VM with {args.pss_vms} idle VMs up: {pss:.1f} MiB")
        finally:
            engine.close()
        parallel = Engine(StateDir(Path(tmp) / "parallel"), templates=templates, pool_size=4)
        try:
            rate = creates_per_second(parallel, threads=4, per_thread=1 if args.smoke else max(3, args.samples // 5))
            print(f"creates per second, 4 in parallel: {rate:.2f}")
        finally:
            parallel.close()
    ready_p50 = pct(ready, 0.5)
    result = {
        "ready_p50_ms": round(ready_p50, 1),
        "ready_p99_ms": round(pct(ready, 0.99), 1),
        "cold_boot_ms": round(statistics.median(cold), 1),
        "restore_speedup": round(statistics.median(cold) / ready_p50, 1),
        "teardown_p50_ms": round(pct(teardown, 0.5), 1),
        "pss_per_vm_mib": round(pss, 1),
        "creates_per_s": round(rate, 2),
        "restore_unpooled_p50_ms": round(pct(unpooled, 0.5), 1),
        "restore_unpooled_p99_ms": round(pct(unpooled, 0.99), 1),
        "restore_fresh_p50_ms": round(pct(fresh, 0.5), 1),  # not even the VMM spawned ahead
        "restore_fresh_p99_ms": round(pct(fresh, 0.99), 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
