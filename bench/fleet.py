"""Jobs through the runner fleet, on real VMs: how fast one job starts on an idle fleet, and throughput.

Each job goes the whole way a GitHub job goes on a fleet host: a signed `workflow_job queued`
webhook, a runner registered just in time (the fake GitHub of tests/fleet, through `responses`) and
started from a fresh copy of the installed release (the stand-in runner of tests/fleet), the
job-started hook, the action submitting `true` to the service over its socket, a VM restored for
it, the runner's exit and clean-up. `max_concurrent_jobs` follows max_runners.

Two measurements, kept apart because they answer different questions:

- idle: `--arrivals` jobs arriving one at a time at a fleet with `min_idle` runners already waiting
  (each job is queued only once the previous one has finished and the fleet is back to `min_idle`
  idle runners, plus `--gap` seconds): queued webhook -> the job's first step, p50 and p99. Nothing
  queues behind anything: this is how fast one job starts.
- throughput: `--jobs` jobs queued at once at max_runners 1, 2 and 4 (min_idle 0): jobs per minute,
  and, for scale, queued -> first step under that load (which is mostly waiting in the queue).

Root, the 'base' template built. Prints the details, then as its last line one JSON object with
idle_queued_to_start_p50_ms / _p99_ms, jobs_per_min_<N> per setting and loaded_queued_to_start_p50_ms /
_p99_ms. `--smoke` (the test suite's run, tests/test_bench_smoke.py): 2 arrivals, 2 jobs at 2 runners.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import responses

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Its jobs are a real fork's pull request (tests/fleet/fleet_fakes.py FORK_PR), a payload no package has:
# without it the smoke run skips, saying so (tests/test_bench_smoke.py).
NEEDS_CAPTURED = ["listendev-lstn.pull_request.opened.from-fork.json"]

from bench.stats import percentile  # noqa: E402
from runner.cli import main as cli  # noqa: E402
from tests.fleet.conftest import LABELS, PYTHON, VERSION, Rig, runner_account, serve, standin_tarball, write_config  # noqa: E402
from tests.fleet.fleet_fakes import FakeGitHub  # noqa: E402

WAIT_S = 3600.0


@contextmanager
def fleet(runners: dict[str, Any], max_concurrent_jobs: int) -> Iterator[Rig]:
    """A served fleet with the stand-in runner installed, on a rig of its own that is removed after."""
    root = Path(tempfile.mkdtemp(prefix="mvc-bench-fleet-", dir="/run"))  # not /tmp: each runner has its own
    root.chmod(0o755)
    secret = secrets.token_hex(16).encode()
    (root / "webhook-secret").write_bytes(secret)
    mock = responses.RequestsMock(assert_all_requests_are_fired=False)
    github = FakeGitHub("octo-org", root / "queue", secret)
    github.install(mock)
    mock.start()
    try:
        with runner_account() as account:
            path = write_config(root, account, runners, max_concurrent_jobs=max_concurrent_jobs)
            tarball, digest = standin_tarball(root)
            if cli(["runner", "install", "--version", VERSION, "--from", str(tarball), "--sha256", digest,
                    "--service-config", str(path)]) != 0:
                raise SystemExit("runner install failed")
            rig = Rig(root, path, github, account, mock)
            with serve(rig):
                yield rig
    finally:
        mock.stop()
        mock.reset()
        shutil.rmtree(root, ignore_errors=True)


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {timeout:.0f} s")
        time.sleep(0.05)


def enqueue(rig: Rig, job_id: int) -> float:
    queued_at = time.time()
    rig.github.enqueue(job_id, [rig.action_step("true")], LABELS, python=str(PYTHON), action=str(ROOT / "action.yml"))
    return queued_at


def finished(rig: Rig, count: int) -> list[dict[str, Any]]:
    wait_for(f"{count} jobs to finish", lambda: len(rig.github.results()) >= count)
    results = rig.github.results()
    failed = [job for job in results if job["result"]["conclusion"] != "success"]
    if failed:
        raise SystemExit(f"job {failed[0]['job_id']} failed: {failed[0]['result']['log'][-2000:]}")
    return results


def idle_arrivals(arrivals: int, min_idle: int, gap_s: float) -> list[float]:
    """Queued -> first step (ms) of jobs arriving one at a time at a fleet with `min_idle` runners waiting."""
    latencies = []
    with fleet({"min_idle": min_idle, "max_runners": min_idle + 1}, max_concurrent_jobs=min_idle + 1) as rig:
        for job_id in range(1, arrivals + 1):
            wait_for(f"{min_idle} idle runners", lambda: sum(r.state.value == "idle" for r in rig.fleet.runners())
                     >= min_idle and len(rig.fleet.runners()) <= min_idle)
            time.sleep(gap_s)  # the runners' processes are up and polling, as on a fleet that has been idle
            queued_at = enqueue(rig, job_id)
            result = next(job for job in finished(rig, job_id) if job["job_id"] == job_id)["result"]
            latencies.append((result["first_step_at"] - queued_at) * 1000)
            print(f"  idle arrival {job_id}: queued -> first step {latencies[-1]:.0f} ms", flush=True)
    return latencies


def throughput(max_runners: int, jobs: int) -> tuple[float, list[float]]:
    """(jobs per minute, queued -> first step latencies in ms) for `jobs` queued at once."""
    with fleet({"min_idle": 0, "max_runners": max_runners}, max_concurrent_jobs=max_runners) as rig:
        started = time.time()
        queued_at = {job_id: enqueue(rig, job_id) for job_id in range(1, jobs + 1)}
        results = finished(rig, jobs)
    ended = max(job["result"]["ended_at"] for job in results)
    latencies = [(job["result"]["first_step_at"] - queued_at[job["job_id"]]) * 1000 for job in results]
    return jobs / (ended - started) * 60, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arrivals", type=int, default=20, help="spaced arrivals at an idle fleet (default 20)")
    parser.add_argument("--min-idle", type=int, default=1, help="runners waiting for the idle arrivals (default 1)")
    parser.add_argument("--gap", type=float, default=2.0, help="seconds the fleet stays idle before each arrival")
    parser.add_argument("--jobs", type=int, default=20, help="jobs queued at once per throughput setting")
    parser.add_argument("--runners", type=int, nargs="+", default=[1, 2, 4], help="max_runners settings")
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    args = parser.parse_args()
    if args.smoke:
        args.arrivals, args.gap, args.jobs, args.runners = 2, 0.5, 2, [2]
    out: dict[str, float] = {}
    idle = idle_arrivals(args.arrivals, args.min_idle, args.gap)
    print(f"idle fleet (min_idle {args.min_idle}), {len(idle)} spaced arrivals: queued -> first step "
          f"p50 {percentile(idle, 0.5):.0f} ms, p99 {percentile(idle, 0.99):.0f} ms", flush=True)
    out["idle_queued_to_start_p50_ms"] = round(percentile(idle, 0.5), 1)
    out["idle_queued_to_start_p99_ms"] = round(percentile(idle, 0.99), 1)
    loaded: list[float] = []
    for max_runners in args.runners:
        per_min, waits = throughput(max_runners, args.jobs)
        loaded += waits
        out[f"jobs_per_min_{max_runners}"] = round(per_min, 1)
        print(f"max_runners {max_runners}, {args.jobs} queued at once: {per_min:.1f} jobs/min; queued to first "
              f"step p50 {percentile(waits, 0.5):.0f} ms, p99 {percentile(waits, 0.99):.0f} ms", flush=True)
    out["loaded_queued_to_start_p50_ms"] = round(percentile(loaded, 0.5), 1)
    out["loaded_queued_to_start_p99_ms"] = round(percentile(loaded, 0.99), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
