"""Job API load benchmark: health's latency while one uid floods the API with large JSON bodies (issue 40, item 9).

Run as root on a host with the `base` template built:  .venv/bin/python bench/api_load.py [--rounds N]

A job service (a `ServiceHost` as `serve` builds it, on the host's engine with no spare pool, so no VM
runs) serves its Unix socket in a process of its own. This process asks `GET /v1/health` over and over,
one request at a time on a fresh connection, as a monitor would; another process, of the same uid, sends
a flood of `POST /v1/jobs` bodies all at once. Each round measures health idle, then during each flood:

  lists    64 bodies of 1 MiB of `[],` (350,000 lists each): the issue's flood, which stalled health 5-6 s
  strings  64 bodies of 1 MiB of `"a",` (260,000 strings each): the costliest parse under the cap on arrays
           and objects, so what the uid's 2 MiB budget in hand has to bound
  small    256 bodies of PEER_SMALL_BODY (16 KiB) of `"a",`, the most a uid may have in the loop at once:
           bodies this small never wait behind the uid's large ones, so only their size bounds them

The last line is one JSON object: health's p50/p99/max (ms) idle and during each flood, each flood's p99
over idle p99, how long each flood took to be answered (s), and whether every body was answered. Goal:
health's p99 during every flood <= 500 ms. All from this same run; the rounds alternate idle and floods,
so the machine's load falls on each alike. On a shared 2-core machine say what else ran beside it.

`--smoke` (the test suite's run, tests/test_bench_smoke.py): one round of smaller floods, no goal judged.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile
from runner.service.api.listeners import PEER_SMALL_BODY

GOAL_P99_MS = 500.0
MIB = 1024 * 1024
SHAPES = {  # name: (one item, the body's size, bodies per flood)
    "lists": (b"[],", MIB, 64),
    "strings": (b'"a",', MIB, 64),
    "small": (b'"a",', PEER_SMALL_BODY, 256),
}
HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
IDLE_SAMPLES, PAUSE = 40, 0.01


def body(item: bytes, size: int) -> bytes:
    """A JSON array of `item`s exactly `size` bytes long (its last item without the comma)."""
    count = (size - 2) // len(item)
    text = b"[" + item * count
    return text[:-1] + b" " * (size - len(text)) + b"]"


def exchange(path: str, request: bytes, timeout: float = 120.0) -> bytes:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def health(path: str) -> float:
    started = time.perf_counter()
    answer = exchange(path, HEALTH)
    if not answer.startswith(b"HTTP/1.1 200"):
        raise SystemExit(f"health answered {answer[:100]!r}")
    return (time.perf_counter() - started) * 1000


# -- the flood, in a process of its own (its threads would otherwise share this process's interpreter lock)


def flood(path: str, shape: str, count: int) -> None:
    item, size, _ = SHAPES[shape]
    data = body(item, size)
    request = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: %d\r\n\r\n" % len(data)) + data
    statuses: list[int] = []

    def submit() -> None:
        answer = exchange(path, request)
        statuses.append(int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else 0)

    threads = [threading.Thread(target=submit) for _ in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"seconds": time.perf_counter() - started, "statuses": sorted(statuses)}))


def during(path: str, shape: str, count: int) -> tuple[list[float], float, list[int]]:
    """Health latencies while the flood runs, the flood's seconds and its answers' statuses (0: none)."""
    proc = subprocess.Popen([sys.executable, __file__, "--flood", path, shape, str(count)], stdout=subprocess.PIPE,
                            text=True)
    samples: list[float] = []
    while proc.poll() is None or not samples:
        samples.append(health(path))
        time.sleep(PAUSE)
    out, _ = proc.communicate()
    report = json.loads(out)
    return samples, float(report["seconds"]), [int(status) for status in report["statuses"]]


# -- the service, in a process of its own


def serve(tmp: Path) -> None:
    """A job service on tmp/api.sock until stdin ends."""
    from runner.service.config.reading import config_from_mapping
    from runner.service.host.assembly import EngineSettings, ServiceHost
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    config = config_from_mapping({"socket": str(tmp / "api.sock"), "state_dir": str(tmp / "state"),
                                  "shutdown_grace_seconds": 0, "prewarm": {"max_vms": 0}})
    engine = EngineSettings(state=StateDir(tmp / "engine"), templates=TemplateStore(StateDir.default().templates),
                            pool_size=0)
    with ServiceHost(config, engine=engine):
        print("ready", flush=True)
        sys.stdin.read()


def start_service(tmp: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(tmp)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit("the job service did not start; see its output above")
    return proc


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 1), "p99": round(percentile(values, 0.99), 1),
            "max": round(max(values), 1)}


def measure(path: str, rounds: int, scale: int) -> dict[str, float]:
    idle: list[float] = []
    floods: dict[str, list[float]] = {name: [] for name in SHAPES}
    seconds: dict[str, list[float]] = {name: [] for name in SHAPES}
    answered = True
    for _ in range(rounds):
        idle += [health(path) for _ in range(IDLE_SAMPLES // scale)]
        for name, (_, _, count) in SHAPES.items():
            samples, took, statuses = during(path, name, count // scale)
            floods[name] += samples
            seconds[name].append(took)
            answered = answered and 0 not in statuses
    out = {f"idle_{key}_ms": value for key, value in summary(idle).items()}
    for name, samples in floods.items():
        numbers = summary(samples)
        out.update({f"{name}_{key}_ms": value for key, value in numbers.items()})
        out[f"{name}_p99_over_idle"] = round(numbers["p99"] / out["idle_p99_ms"], 1)
        out[f"{name}_flood_s"] = round(statistics.median(seconds[name]), 2)
        out[f"{name}_samples"] = len(samples)
    out["every_body_answered"] = int(answered)
    return out


def report(out: dict[str, float], scale: int, smoke: bool) -> None:
    print(f"health idle: p50 {out['idle_p50_ms']} ms, p99 {out['idle_p99_ms']} ms")
    for name, (item, size, count) in SHAPES.items():
        missed = out[f"{name}_p99_ms"] > GOAL_P99_MS
        verdict = "" if smoke else ("  MISSED" if missed else "  ok")
        print(f"during {name:8s} ({count // scale} x {size // 1024} KiB of {item.decode()!r}): p50 {out[f'{name}_p50_ms']} ms, "
              f"p99 {out[f'{name}_p99_ms']} ms (goal <= {GOAL_P99_MS:g}), max {out[f'{name}_max_ms']} ms, "
              f"{out[f'{name}_samples']} samples; the flood answered in {out[f'{name}_flood_s']} s{verdict}")
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--flood", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve)
    if args.flood:
        path, shape, count = args.flood
        return flood(path, shape, int(count))
    if os.geteuid() != 0:
        raise SystemExit("bench/api_load.py needs root (the job service runs its VM engine)")
    tmp = Path(tempfile.mkdtemp(prefix="mvc-bench-api-", dir="/tmp"))
    service = start_service(tmp)
    scale = 8 if args.smoke else 1
    try:
        out = measure(str(tmp / "api.sock"), 1 if args.smoke else args.rounds, scale)
    finally:
        assert service.stdin is not None
        service.stdin.close()
        service.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    report(out, scale, args.smoke)


if __name__ == "__main__":
    main()
