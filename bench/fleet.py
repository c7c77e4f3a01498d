"""Jobs through the runner fleet: 20 queued `true` jobs at max_runners 1, 2 and 4, on real VMs.

Each job goes the whole way a GitHub job goes on a fleet host: a signed `workflow_job queued`
webhook, a runner registered just in time (the fake GitHub of tests/fleet, through `responses`) and
started from a fresh copy of the installed release (the stand-in runner of tests/fleet), the
job-started hook, the action submitting `true` to the service over its socket, a VM restored for
it, the runner's exit and clean-up. `max_concurrent_jobs` follows max_runners.

Root, the 'base' template built. Prints, per setting, the throughput and the latency from the queued
webhook to the job's first step; as its last line one JSON object with jobs_per_min_1, _2, _4 and
queued_to_start_p50_ms / _p99_ms (over all 60 jobs).
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import responses

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stats import percentile  # noqa: E402
from runner.cli import main as cli  # noqa: E402
from tests.fleet.conftest import LABELS, PYTHON, VERSION, Rig, runner_account, serve, standin_tarball, write_config  # noqa: E402
from tests.fleet.fleet_fakes import FakeGitHub  # noqa: E402

JOBS = 20


def one_setting(max_runners: int) -> tuple[float, list[float]]:
    """(jobs per minute, queued-to-first-step latencies in ms) for JOBS jobs at `max_runners`."""
    root = Path(tempfile.mkdtemp(prefix="mvc-bench-fleet-", dir="/tmp"))
    root.chmod(0o755)
    secret = secrets.token_hex(16).encode()
    (root / "webhook-secret").write_bytes(secret)
    mock = responses.RequestsMock(assert_all_requests_are_fired=False)
    github = FakeGitHub("octo-org", root / "queue", secret)
    github.install(mock)
    mock.start()
    try:
        with runner_account() as account:
            path = write_config(root, account, {"min_idle": 0, "max_runners": max_runners},
                                max_concurrent_jobs=max_runners)
            tarball, digest = standin_tarball(root)
            assert cli(["runner", "install", "--version", VERSION, "--from", str(tarball), "--sha256", digest,
                        "--service-config", str(path)]) == 0
            rig = Rig(root, path, github, account)
            with serve(rig):
                return _run(rig)
    finally:
        mock.stop()
        shutil.rmtree(root, ignore_errors=True)


def _run(rig: Rig) -> tuple[float, list[float]]:
    queued_at: dict[int, float] = {}
    started = time.time()
    for job_id in range(1, JOBS + 1):
        queued_at[job_id] = time.time()
        rig.github.enqueue(job_id, [rig.action_step("true")], LABELS, python=str(PYTHON),
                           action=str(ROOT / "action.yml"))
    deadline = time.monotonic() + 3600
    while len(rig.github.results()) < JOBS:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(rig.github.results())} of {JOBS} jobs finished within an hour")
        time.sleep(0.2)
    results = rig.github.results()
    failed = [job["job_id"] for job in results if job["result"]["conclusion"] != "success"]
    if failed:
        raise SystemExit(f"jobs {failed} failed: {results[0]['result']['log'][-2000:]}")
    ended = max(job["result"]["ended_at"] for job in results)
    latencies = [(job["result"]["first_step_at"] - queued_at[job["job_id"]]) * 1000 for job in results]
    return JOBS / (ended - started) * 60, latencies


def main() -> None:
    out: dict[str, float] = {}
    latencies: list[float] = []
    for max_runners in (1, 2, 4):
        per_min, waits = one_setting(max_runners)
        latencies += waits
        out[f"jobs_per_min_{max_runners}"] = round(per_min, 1)
        print(f"max_runners {max_runners}: {per_min:.1f} jobs/min; queued to first step p50 "
              f"{percentile(waits, 0.5):.0f} ms, p99 {percentile(waits, 0.99):.0f} ms", flush=True)
    out["queued_to_start_p50_ms"] = round(percentile(latencies, 0.5), 1)
    out["queued_to_start_p99_ms"] = round(percentile(latencies, 0.99), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
