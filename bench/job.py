"""Benchmark of the job service on real VMs: what a job costs on top of the command itself.

Runs an in-process service on a private socket and engine root (sharing only the built templates),
and drives it through the API client, as the action does. Prints medians and p99s, then, as its last
line, one JSON object:

- job_overhead_p50_ms / _p99_ms: submit (with a 1 MiB checkout), run `true`, the result back, the VM
  destroyed: the whole round trip as a client sees it, for `--jobs` (40) jobs arriving at a steady rate
  (one every `--load`^-1 service times: half the capacity by default, the service running one job at a
  time), so the tail shows what a job meets on a busy but not saturated host; the rate is printed
  (arrivals_per_s, and arrival_load = rate x the mean back-to-back round trip over `--probes` jobs, enough
  to drain the spare pool: a sustained capacity, not the pool's burst).
- bare_subprocess_p50_ms: `sh -c true` on the host, for scale.
- log_first_byte_p99_ms: from the moment the service receives a chunk of guest output from the
  engine (the entry's `ts`) to the client holding it: the service's own streaming latency.
- checkout_mb_per_s: a 100 MiB checkout from the client into the guest's /workspace (upload and
  spool, then made into a disk image on the host and mounted in the guest), in MB/s (10^6 bytes).
- checkout_100mib_ms: the same checkout's time, upload to the command's start, in ms.

Needs root, QEMU and the built `base` template. Usage: python bench/job.py [--jobs 40] [--load 0.5 | --rate R]
`--smoke` (the test suite's run, tests/test_bench_smoke.py): 3 jobs and an 8 MiB checkout, no goal judged.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stats import percentile
from runner.jobapi.client import JobClient
from runner.jobapi.contract import JobRecord, JobSpec
from runner.service.config.reading import config_from_mapping
from runner.service.host.assembly import EngineSettings, ServiceHost
from runner.vm.engine import Engine
from runner.vm.statedir import StateDir

# The smoke run's one capacity probe measures nothing worth a share of, so its 3 jobs come at a fixed rate
# (which keeps --rate's path running too).
SMOKE_ARGS = ["--smoke", "--rate", "0.5"]
SHA = "0" * 40
MIB = 1024 * 1024


def tar_of_file(path: Path, name: str) -> Iterator[bytes]:
    """A tar stream with one file, produced piecewise so a big checkout never sits in memory."""
    size = path.stat().st_size
    info = tarfile.TarInfo(name)
    info.size = size
    yield info.tobuf(format=tarfile.PAX_FORMAT)
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            yield chunk
    yield b"\0" * ((512 - size % 512) % 512) + b"\0" * 1024


def small_checkout() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = os.urandom(MIB)
        info = tarfile.TarInfo("blob.bin")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def spec(command: str, **fields) -> JobSpec:
    return JobSpec(repository="bench/job", sha=SHA, job_name="bench", command=command, **fields)


def run_job(client: JobClient, engine: Engine | None, checkout: bytes, command: str = "true") -> tuple[float, JobRecord]:
    """One job's round trip; with `engine`, also that no VM is left once the result is back (jobs one at a time)."""
    begin = time.perf_counter()
    job = client.submit(spec(command)).id
    client.upload_checkout(job, checkout)
    for _ in client.logs(job):
        pass
    rec = client.get(job)
    took = (time.perf_counter() - begin) * 1000
    if rec.state != "finished" or rec.exit_code != 0:
        raise SystemExit(f"bench job {job} ended {rec.state} ({rec.error})")
    if engine is not None and engine.live():
        raise SystemExit(f"bench job {job}: its VM is still alive after the result came back")
    return took, rec


def steady_arrivals(socket: str, checkout: bytes, jobs: int, interval_s: float) -> list[tuple[float, JobRecord]]:
    """`jobs` jobs submitted one every `interval_s` (open loop: an arrival never waits for an earlier job),
    each by a client of its own; their round trips in arrival order."""
    results: list[tuple[float, JobRecord] | None] = [None] * jobs
    errors: list[BaseException] = []

    def one(index: int) -> None:
        client = JobClient(socket=socket)
        try:
            results[index] = run_job(client, None, checkout)
        except BaseException as exc:  # reported below, never swallowed
            errors.append(exc)
        finally:
            client.close()

    start = time.perf_counter()
    workers = []
    for index in range(jobs):
        time.sleep(max(0.0, start + index * interval_s - time.perf_counter()))
        workers.append(threading.Thread(target=one, args=(index,)))
        workers[-1].start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def bench_overhead(client: JobClient, engine: Engine, socket: str, jobs: int, load: float,
                   probes: int, fixed_rate: float | None = None
                   ) -> tuple[list[float], list[JobRecord], list[float], float, float, int]:
    """(round trips, records, bare subprocess times, arrivals per second, back-to-back mean ms, pool misses
    among the steady arrivals). `fixed_rate` (arrivals per second) replaces `load`'s share of the capacity."""
    checkout = small_checkout()
    run_job(client, engine, checkout)  # warm the page cache and the engine's pool
    # The service runs one job at a time, so capacity is 1 / the round trip, but a sustained one: a
    # back-to-back job also waits for the spare VM its predecessor's refill is still restoring. The median
    # of a few probes is served from the pool's spares alone and overstates it (seen: 279 ms median, then
    # misses of 600-800 ms at half that "capacity"); the mean over enough probes to drain the pool does not.
    back_to_back = statistics.fmean(run_job(client, engine, checkout)[0] for _ in range(probes))
    rate = fixed_rate if fixed_rate is not None else load / (back_to_back / 1000)
    misses_before = engine.pool.misses
    results = steady_arrivals(socket, checkout, jobs, 1 / rate)
    misses = engine.pool.misses - misses_before
    deadline = time.monotonic() + 60
    while engine.live() and time.monotonic() < deadline:  # the last job's VM goes just after its result
        time.sleep(0.05)
    if engine.live():
        raise SystemExit("bench jobs left VMs alive after their results came back")
    round_trips, records = [r[0] for r in results], [r[1] for r in results]
    bare = []
    for _ in range(jobs):
        begin = time.perf_counter()
        subprocess.run(["sh", "-c", "true"], check=True)
        bare.append((time.perf_counter() - begin) * 1000)
    return round_trips, records, bare, rate, back_to_back, misses


def phases(records: list[JobRecord]) -> str:
    """Medians of where a job's time went, from the service's own records."""
    def median_ms(start: str, end: str) -> float:
        return statistics.median((getattr(r.timings, end) - getattr(r.timings, start)) * 1000 for r in records)
    ready = statistics.median(r.timings.vm_ready_ms for r in records)
    return (f"VM restore {ready:.0f} ms, checkout into guest {median_ms('vm_ready_at', 'started_at'):.0f} ms, "
            f"command + VM destroy {median_ms('started_at', 'finished_at'):.0f} ms")


def slowest(round_trips: list[float], records: list[JobRecord], count: int = 3) -> str:
    """Where the tail's time went, job by job: a pool miss shows as a long restore, a busy host as
    everything slower at once, queueing as time before the restore began."""
    def parts(total: float, r: JobRecord) -> str:
        t = r.timings
        assert t.queued_at is not None and t.vm_ready_at is not None and t.started_at is not None \
            and t.finished_at is not None and t.vm_ready_ms is not None
        before = (t.vm_ready_at - t.queued_at) * 1000 - t.vm_ready_ms
        return (f"{total:.0f} ms = queue/submit {before:.0f} + restore {t.vm_ready_ms:.0f} + checkout "
                f"{(t.started_at - t.vm_ready_at) * 1000:.0f} + command/destroy {(t.finished_at - t.started_at) * 1000:.0f}")
    ranked = sorted(zip(round_trips, records), key=lambda pair: pair[0], reverse=True)[:count]
    return "; ".join(parts(total, r) for total, r in ranked)


def bench_log_latency(client: JobClient) -> tuple[list[float], float]:
    """Per line: service receipt -> client. Also: exec start on the host -> the first byte at the client."""
    job = client.submit(spec("i=0; while [ $i -lt 40 ]; do echo line-$i; i=$((i+1)); sleep 0.05; done")).id
    client.upload_checkout(job, small_checkout())
    latencies, first_at = [], None
    for entry in client.logs(job):
        if entry.stream == "stdout":
            now = time.time()
            first_at = first_at or now
            latencies.append((now - entry.ts) * 1000)
    if not latencies:
        raise SystemExit("the log bench job printed nothing")
    return latencies, (first_at - client.get(job).timings.started_at) * 1000


def bench_checkout(client: JobClient, tmp: Path, mib: int = 100) -> tuple[float, float]:
    blob = tmp / "blob.bin"
    with open(blob, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MIB))
    size = blob.stat().st_size
    job = client.submit(spec("test $(stat -c %s big.bin) -eq " + str(size), timeout_seconds=600)).id
    begin = time.perf_counter()
    client.upload_checkout(job, tar_of_file(blob, "big.bin"))
    upload_s = time.perf_counter() - begin
    for _ in client.logs(job):
        pass
    rec = client.get(job)
    if rec.exit_code != 0:
        raise SystemExit(f"the checkout did not arrive whole in the guest: {rec}")
    unpack_s = rec.timings.started_at - rec.timings.vm_ready_at
    return size / upload_s / 1e6, size / (upload_s + unpack_s) / 1e6


def follow(socket: str, job: str, token: str | None) -> None:
    """A client of its own following the job's log to its end."""
    with JobClient(socket=socket) as follower:
        if token:
            follower.job_tokens[job] = token
        for _ in follower.logs(job):
            pass


def bench_queued(client: JobClient, host: ServiceHost, count: int) -> str:
    """`count` jobs queued behind a running one, each with a client following its log (as `run` and the
    action do): what the service then holds, from its own listener (issue 17: a stream costs an fd, no thread)."""
    blocker = client.submit(spec("sleep 600", timeout_seconds=900)).id
    client.upload_checkout(blocker, small_checkout())
    jobs = [client.submit(spec("true")).id for _ in range(count)]
    followers = []
    for job in jobs:
        client.upload_checkout(job, small_checkout())
        followers.append(threading.Thread(target=follow, args=(client.where, job, client.job_tokens.get(job))))
        followers[-1].start()
    assert host.api is not None
    unix = host.api.servers[0]
    deadline = time.monotonic() + 120
    while unix.stats()["streams"] < count and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = unix.stats()
    listener = sum(1 for t in threading.enumerate() if t.name.startswith(unix.name))
    line = (f"{count} queued jobs, each followed: the API listener holds {stats['connections']} connections (fds; "
            f"cap {unix.limits.max_connections}) and {listener} threads ({stats['workers']} of "
            f"{unix.limits.max_workers} workers busy, {stats['streams']} log streams on one stream thread); "
            f"service process: {threading.active_count()} threads, {len(os.listdir('/proc/self/fd'))} fds "
            f"(both include the {count} benchmark clients)")
    for job in [*jobs, blocker]:
        client.cancel(job)
    for follower in followers:
        follower.join(60)
    return line


def positive(text: str) -> float:
    """An argparse type: a number above 0 (a rate or a share of capacity of 0 would never send a job)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not above 0")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40, help="jobs arriving at a steady rate (default 40)")
    pace = parser.add_mutually_exclusive_group()
    pace.add_argument("--load", type=positive, default=0.5,
                      help="arrival rate as a share of capacity (1 / the mean back-to-back round trip), default 0.5")
    parser.add_argument("--probes", type=int, default=12,
                        help="back-to-back jobs that measure the capacity (enough to drain the 2-VM pool)")
    pace.add_argument("--rate", type=positive, default=None,
                      help="arrivals per second, instead of --load's share of the capacity measured in this run "
                           "(to compare two builds at one rate)")
    parser.add_argument("--queued", type=int, default=200, help="jobs queued at once for the threads/fds line")
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    args = parser.parse_args()
    checkout_mib = 8 if args.smoke else 100
    if args.smoke:
        args.jobs, args.probes, args.queued = 3, 1, 10
    templates = StateDir.default().templates
    tmp = Path(tempfile.mkdtemp(prefix="mvc-bench-job-", dir="/tmp"))
    (tmp / "state").mkdir()
    os.symlink(templates, tmp / "state" / "templates")
    config = config_from_mapping({"socket": str(tmp / "api.sock"), "state_dir": str(tmp / "state"),
                                  "max_concurrent_jobs": 1, "checkout_max_bytes": "200MiB",
                                  "max_queued_jobs": args.queued + 8,
                                  "shutdown_grace_seconds": 0})
    client = JobClient(socket=config.socket)
    try:
        with ServiceHost(config, engine=EngineSettings(pool_size=2)) as host:
            assert host.engine is not None and host.service is not None
            jobs, records, bare, rate, back_to_back, misses = bench_overhead(client, host.engine, config.socket, args.jobs,
                                                                     args.load, args.probes, args.rate)
            logs, exec_to_first = bench_log_latency(client)
            upload_mb_s, checkout_mb_s = bench_checkout(client, tmp, checkout_mib)
            queued_line = bench_queued(client, host, args.queued)
            accel = host.service.vms.accel
    finally:
        client.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"accel: {accel}")
    print(f"capacity: back-to-back round trip mean {back_to_back:.0f} ms over {args.probes} jobs; arrivals {rate:.2f}/s "
          f"(one every {1000 / rate:.0f} ms, {rate * back_to_back / 1000:.2f} of capacity)")
    print(f"job round trip (1 MiB checkout, `true`, VM destroyed), {len(jobs)} jobs at that rate: "
          f"median {statistics.median(jobs):.1f} ms, p99 {percentile(jobs, 0.99):.1f} ms, "
          f"p99/p50 {percentile(jobs, 0.99) / statistics.median(jobs):.2f}")
    print(f"  where it went (medians): {phases(records)}")
    print(f"  the slowest: {slowest(jobs, records)}")
    print(f"  pool misses (a take found no spare VM and restored its own): {misses} of {len(jobs)}")
    vm_ms = [(r.timings.finished_at - r.timings.vm_ready_at) * 1000 + r.timings.vm_ready_ms for r in records]
    own = [total - vm for total, vm in zip(jobs, vm_ms)]
    print(f"  the service's own share (round trip minus VM restore, checkout, command, destroy): "
          f"median {statistics.median(own):.1f} ms")
    print(f"bare `sh -c true` on the host: median {statistics.median(bare):.2f} ms")
    print(f"log entry service->client, {len(logs)} lines: median {statistics.median(logs):.2f} ms, "
          f"p99 {percentile(logs, 0.99):.2f} ms; exec start -> first byte at the client (incl. the guest's "
          f"shell start): {exec_to_first:.0f} ms")
    print(f"{checkout_mib} MiB checkout: upload+spool {upload_mb_s:.0f} MB/s, into the guest {checkout_mb_s:.0f} MB/s")
    print(queued_line)
    print(json.dumps({
        "job_overhead_p50_ms": round(statistics.median(jobs), 1),
        "job_overhead_p99_ms": round(percentile(jobs, 0.99), 1),
        "job_overhead_p99_over_p50": round(percentile(jobs, 0.99) / statistics.median(jobs), 2),
        "arrivals_per_s": round(rate, 3),
        "arrival_load": round(rate * back_to_back / 1000, 2),
        "bare_subprocess_p50_ms": round(statistics.median(bare), 2),
        # Same-run ratio: how many bare `sh -c true` runs one whole VM job costs on this host right now.
        "overhead_vs_bare": round(statistics.median(jobs) / statistics.median(bare), 1),
        "log_first_byte_p99_ms": round(percentile(logs, 0.99), 2),
        "checkout_mb_per_s": round(checkout_mb_s, 1),
        "checkout_100mib_ms": round(100 * MIB / checkout_mb_s / 1e3, 1),  # at the measured rate
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
