"""Benchmark of the client side: what `microvm-check` itself costs around a job (issue 26).

Everything runs the installed `microvm-check` command as a user would (a new process each time):

- start-up: `--version`, `--help`, `policy check FILE`, `jobs` (on a socket nobody serves): p50, p90;
- `run -- true` through a running `microvm-check serve` (its own state directory, sharing only the built
  templates; the spare pool warm), split from the job's record into the client's share (process start
  to submit, plus the job's end to the process's exit), the service's (submit to finished) and the VM's
  ready time (`vm_ready_ms`, for the "VM-ready share unchanged" check);
- `run -- true` with no service (the in-process one-job service: one VM restored, no spare pool).

Wall clocks (time.time) on both sides: one host, so the record's timestamps and the process's compare.
The commands run with their modules byte-compiled, as an installed CLI's are: a private bytecode cache
(PYTHONPYCACHEPREFIX in the bench's temporary directory, PYTHONDONTWRITEBYTECODE unset for them), filled
by one untimed run of each command first.
Needs root, QEMU and the built `base` template. Usage: python bench/client.py [--runs 10] [--cli PATH]
[--baseline PATH] (`--smoke`: two runs each, no goal judged; `--baseline`: another install's command
measured sample by sample interleaved with this one, with new/baseline ratios of the medians). The goals:
--version p50 <= 100 ms; run through serve p50 <= 300 ms; run without a service p50 <= 1.5 s. Last line:
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import percentile
from runner.jobapi.client import JobAPIError, JobClient
from runner.vm.statedir import StateDir

CLI = str(Path(sys.executable).parent / "microvm-check")
# With --baseline, every sample of this install is followed by one of the baseline's, so both see the same
# load (the machine is shared): the baseline's figures are printed as baseline_*, with new/baseline ratios.
Samples = dict[str, list[float]]


# The measured commands run as an installed CLI does: with their modules byte-compiled (pip compiles a
# wheel's at install; any first run writes them). Under PYTHONDONTWRITEBYTECODE=1 (set on some machines)
# an editable install would instead compile every module it imports from source on each start, which
# no user of a real install pays. So each command gets a private bytecode cache (PYTHONPYCACHEPREFIX,
# under the bench's temporary directory: no install or source tree is written), filled by one run of
# each command before the timed ones.
ENV: dict[str, str] = dict(os.environ)


def use_bytecode_cache(directory: Path) -> None:
    ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    ENV["PYTHONPYCACHEPREFIX"] = str(directory)
    print(f"measured with byte-compiled modules: a private cache in {directory}, filled by an untimed first run")


def timed(cli: str, argv: list[str], cwd: Path) -> tuple[float, float, subprocess.CompletedProcess[bytes]]:
    """(start, end) wall-clock seconds around one run of the command, and its result."""
    start = time.time()
    done = subprocess.run([cli, *argv], cwd=cwd, capture_output=True, timeout=300, check=False, env=ENV)
    return start, time.time(), done


def summary(name: str, values_ms: list[float]) -> dict[str, float]:
    p50, p90 = statistics.median(values_ms), percentile(values_ms, 0.9)
    print(f"{name:<40} p50 {p50:8.1f} ms   p90 {p90:8.1f} ms   (n={len(values_ms)})")
    return {f"{name}_p50_ms": round(p50, 1), f"{name}_p90_ms": round(p90, 1)}


def summaries(per_cli: list[Samples]) -> dict[str, float]:
    """This install's figures, then the baseline's (baseline_*) and the ratios of their medians."""
    out: dict[str, float] = {}
    for name, values in per_cli[0].items():
        out |= summary(name, values)
        if len(per_cli) > 1:
            base = per_cli[1][name]
            out |= summary(f"baseline_{name}", base)
            ratio = statistics.median(values) / max(statistics.median(base), 1e-9)
            print(f"{name + ' new/baseline':<40} {ratio:8.2f}")
            out[f"{name}_ratio"] = round(ratio, 3)
    return out


def start_up(runs: int, work: Path, clis: list[str]) -> dict[str, float]:
    policy = work / "policy.yml"
    policy.write_text("version: 1\nmode: block\n")
    per_cli: list[Samples] = [{} for _ in clis]
    for name, argv in (("version", ["--version"]), ("help", ["--help"]),
                       ("policy_check", ["policy", "check", str(policy)]),
                       ("jobs_no_service", ["jobs", "--socket", str(work / "nobody.sock")])):
        for cli in clis:
            timed(cli, argv, work)  # fills the bytecode cache (untimed)
        for _ in range(runs):
            for cli, samples in zip(clis, per_cli):
                start, end, _done = timed(cli, argv, work)
                samples.setdefault(name, []).append((end - start) * 1000)
    return summaries(per_cli)


def serve(work: Path) -> subprocess.Popen[bytes]:
    """`microvm-check serve` on a private socket and state directory whose templates are the host's."""
    state = work / "state"
    state.mkdir()
    (state / "templates").symlink_to(StateDir.default().templates)
    config = work / "service.yml"
    config.write_text(f"socket: {work}/api.sock\nstate_dir: {state}\ntemplates: [base]\nmax_concurrent_jobs: 1\n")
    proc = subprocess.Popen([CLI, "serve", "--config", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(work / "serve.log", "wb"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with JobClient(socket=str(work / "api.sock")) as client:
                client.health()
            return proc
        except JobAPIError:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited: {(work / 'serve.log').read_text()[-2000:]}") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("serve did not answer within 120 s")


def through_serve(runs: int, work: Path, checkout: Path, clis: list[str]) -> dict[str, float]:
    """`run -- true` of each install against one `serve` (this install's): the service's side is the same
    for both, so the client shares compare."""
    proc = serve(work)
    sock = str(work / "api.sock")
    try:
        for cli in clis:  # the pool's first fill and the first restore; each client's bytecode cache
            timed(cli, ["run", "--socket", sock, "--", "true"], checkout)
        time.sleep(2)  # the spare VM restored after that one
        per_cli: list[Samples] = [{} for _ in clis]
        for _ in range(runs):
            for cli, samples in zip(clis, per_cli):
                start, end, done = timed(cli, ["run", "--socket", sock, "--", "true"], checkout)
                assert done.returncode == 0, done.stderr.decode(errors="replace")
                with JobClient(socket=sock) as client:
                    rec = client.list(1)[0]
                t = rec.timings
                assert t.finished_at is not None
                for name, value in (("run_serve", end - start),
                                    ("run_serve_client_share", (rec.created_at - start) + (end - t.finished_at)),
                                    ("run_serve_service_share", t.finished_at - rec.created_at),
                                    ("run_serve_vm_ready", (t.vm_ready_ms or 0.0) / 1000)):
                    samples.setdefault(name, []).append(value * 1000)
                time.sleep(1)  # the pool refills between jobs, as between a project's checks
        return summaries(per_cli)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def without_service(runs: int, work: Path, checkout: Path, clis: list[str]) -> dict[str, float]:
    per_cli: list[Samples] = [{} for _ in clis]
    for cli in clis:  # the in-process service's modules into the bytecode cache (untimed)
        timed(cli, ["run", "--socket", str(work / "nobody.sock"), "--", "true"], checkout)
    for _ in range(runs):
        for cli, samples in zip(clis, per_cli):
            start, end, done = timed(cli, ["run", "--socket", str(work / "nobody.sock"), "--", "true"], checkout)
            assert done.returncode == 0, done.stderr.decode(errors="replace")
            samples.setdefault("run_no_service", []).append((end - start) * 1000)
    return summaries(per_cli)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="two runs of each, no goal judged")
    parser.add_argument("--cli", help="the microvm-check command to measure (default: this venv's)")
    parser.add_argument("--baseline", help="another install's microvm-check, measured interleaved with --cli")
    args = parser.parse_args()
    global CLI
    CLI = args.cli or CLI
    clis = [CLI, args.baseline] if args.baseline else [CLI]
    runs = 2 if args.smoke else args.runs
    if os.geteuid() != 0:
        raise SystemExit("bench/client.py needs root (VMs, namespaces)")
    work = Path(tempfile.mkdtemp(prefix="mvc-bench-client-"))
    try:
        checkout = work / "checkout"
        checkout.mkdir()
        (checkout / "README").write_text("a trivial checkout\n")
        use_bytecode_cache(work / "pycache")
        results = start_up(runs, work, clis)
        (work / "serve").mkdir()
        results |= through_serve(runs, work / "serve", checkout, clis)
        results |= without_service(runs, work, checkout, clis)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    goals = {"version_p50_ms": 100, "run_serve_p50_ms": 300, "run_no_service_p50_ms": 1500}
    for key, goal in goals.items():
        verdict = "" if args.smoke else ("  ok" if results[key] <= goal else "  MISSED")
        print(f"goal {key} <= {goal}: {results[key]}{verdict}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
