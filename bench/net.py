"""Benchmark of per-VM networking: slot set-up, teardown, release, and the cost of a policy.

Needs root. Everything happens in namespaces this script makes (prefix `bn<random>`), attached to
an uplink namespace of its own; no packet leaves them. Prints medians and p99 per measurement and,
last, one JSON line with the headline numbers.

    .venv/bin/python bench/net.py [--runs 40]

`--smoke` (the test suite's run, tests/test_bench_smoke.py): 3 runs of each, no goal judged.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import percentile
from policy import load_policy
from runner.net import NamespaceUplink, SlotPool, Upstream, netns

POLICY = """\
version: 1
mode: block
allow:
  - host: pypi.org
    ports: [443]
  - host: "*.pythonhosted.org"
    ports: [443]
  - host: github.com
    ports: [22, 443]
  - cidr: 10.20.0.0/16
    ports: [80, 443]
  - cidr: 203.0.113.0/24
    ports: [53]
    protocol: udp
"""


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1000, result


def report(name: str, samples: list[float]) -> tuple[float, float]:
    """Print one measurement; its p50 (median) and p99."""
    median, p99 = statistics.median(samples), percentile(samples, 0.99)
    print(f"{name:<28} p50 {median:7.2f} ms   p99 {p99:7.2f} ms   n={len(samples)}")
    return median, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    args = parser.parse_args()
    if args.smoke:
        args.runs = 3
    prefix = "bn" + secrets.token_hex(3)
    uplink_ns = f"{prefix}-up"
    policy = load_policy(POLICY, "bench-policy.yml")
    netns.create(uplink_ns)
    pool = SlotPool(prefix, NamespaceUplink(uplink_ns), size=0, upstream=Upstream("192.0.2.53"))
    setup, teardown, ready, release = [], [], [], []
    try:
        pool.start()
        for _ in range(args.runs):
            ms, slot = timed(pool.acquire)  # empty pool: acquire creates the slot
            setup.append(ms)
            teardown.append(timed(lambda: pool.discard(slot))[0])
        slot = pool.acquire()
        pool.release(slot)
        for _ in range(args.runs):
            slot = pool.acquire()
            ready.append(timed(lambda: slot.apply_policy(policy))[0])
            release.append(timed(lambda: pool.release(slot))[0])
    finally:
        pool.close()
        netns.remove(uplink_ns)
    results: dict[str, float] = {}
    for key, name, samples in (("slot_setup", "slot setup", setup), ("slot_teardown", "slot teardown", teardown),
                               ("policy_ready_cost", "policy on pooled slot", ready),
                               ("slot_release", "slot release (clean-up)", release)):
        p50, p99 = report(name, samples)
        results[f"{key}_p50_ms"] = round(p50, 2)
        results[f"{key}_p99_ms"] = round(p99, 2)
    # Same-run ratio: what a pooled slot saves, a fresh slot's set-up against applying a policy to a pooled one.
    results["setup_vs_policy_ratio"] = round(statistics.median(setup) / statistics.median(ready), 1)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
