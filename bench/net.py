"""Benchmark of per-VM networking: slot set-up, teardown, release, and the cost of a policy.

Needs root. Everything happens in namespaces this script makes (prefix `bn<random>`), attached to
an uplink namespace of its own; no packet leaves them. Prints medians and p99 per measurement and,
last, one JSON line with the headline numbers.

    .venv/bin/python bench/net.py [--runs 40]
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from collections.abc import Callable

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


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1000, result


def report(name: str, samples: list[float]) -> float:
    median = statistics.median(samples)
    print(f"{name:<28} p50 {median:7.2f} ms   p99 {percentile(samples, 0.99):7.2f} ms   n={len(samples)}")
    return median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
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
    results = {
        "slot_setup_p50_ms": round(report("slot setup", setup), 2),
        "slot_teardown_p50_ms": round(report("slot teardown", teardown), 2),
        "policy_ready_cost_p50_ms": round(report("policy on pooled slot", ready), 2),
        "slot_release_p50_ms": round(report("slot release (clean-up)", release), 2),
    }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
