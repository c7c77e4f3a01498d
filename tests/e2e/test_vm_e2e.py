"""The job service end to end on real VMs (QEMU, the built `base` template, root).

Skipped locally when any of those is missing; failing under CI=true. Each test gets a private engine
state directory (sharing only the read-only templates), and teardown fails the test if a VMM process
or a VM directory is left behind.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from runner.jobapi.client import JobAPIError, JobClient
from runner.service.jobs.records import RecordStore
from tests.e2e.vm_jobs import output, submit, templates, vm_host, vm_root, vm_service  # noqa: F401 (fixtures)
from tests.reference import captured

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]


def test_passing_and_failing_commands(vm_service) -> None:
    service, client = vm_service()
    ok = submit(client, "cat README && echo from-$MICROVM_CHECK_JOB_ID && pwd", env={"GITHUB_SHA": "abc"})
    bad = submit(client, "echo boom >&2; exit 3")
    # plain words start without a shell (runner/service/jobs/command.py); one the guest cannot start is then
    # run by the shell, which says so as it always did
    plain, missing = submit(client, "cat README"), submit(client, "no-such-program --version")
    assert output(client, ok) == f"hello\nfrom-{ok}\n/workspace\n".encode()
    assert output(client, bad) == b"boom\n"
    assert output(client, plain) == b"hello\n"
    assert b"no-such-program: not found" in output(client, missing)
    good, failed = client.get(ok), client.get(bad)
    assert (good.state, good.exit_code) == ("finished", 0)
    assert (failed.state, failed.exit_code) == ("finished", 3)
    assert (client.get(plain).state, client.get(plain).exit_code) == ("finished", 0)
    assert (client.get(missing).state, client.get(missing).exit_code) == ("finished", 127)
    for rec in (good, failed):
        assert rec.vm_id and rec.policy_digest.startswith("sha256:") and rec.warm is False
        t = rec.timings
        assert t.queued_at <= t.vm_ready_at <= t.started_at <= t.finished_at
        assert t.vm_ready_ms > 0
    assert service.health().accel in ("kvm", "tcg")


def test_artifacts_come_back_validated(vm_service) -> None:
    service, client = vm_service()
    job = submit(client, "mkdir -p out/sub && echo '<r/>' > out/report.xml && printf x > out/sub/a.bin",
                 artifacts=["out/report.xml", "out/sub"], working_directory=".")
    output(client, job)
    rec = client.get(job)
    assert rec.state == "finished"
    assert sorted((a.path, a.size) for a in rec.artifacts) == [("out/report.xml", 5), ("out/sub/a.bin", 1)]
    buf = io.BytesIO()
    client.artifacts(job, buf)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        assert tar.extractfile("out/report.xml").read() == b"<r/>\n"


def test_artifacts_from_a_directory_glob_come_back_and_bad_files_are_named(vm_service) -> None:
    """Issue 8: `out/**` with nested files and overlapping globs, a symlink, a fifo and one oversize file.

    The regular files come back once each, the others are named in the log and as markers in the
    clean tar, and the job's result is the command's exit code.
    """
    service, client = vm_service(artifacts={"max_count": 100, "max_total_bytes": "1MiB"})
    job = submit(client, "mkdir -p out/sub/deep && echo a > out/a.txt && echo '<r/>' > out/sub/r.xml"
                         " && echo d > out/sub/deep/d.bin && echo '<x/>' > report.xml"
                         " && ln -s /etc/shadow out/link && mknod out/fifo p"
                         " && head -c 2000000 /dev/zero > out/big.bin && exit 3",
                 artifacts=["out/**", "out/**/*.xml", "report.xml"])
    output(client, job)
    rec = client.get(job)
    assert (rec.state, rec.exit_code, rec.error) == ("finished", 3, None)
    assert sorted((a.path, a.size) for a in rec.artifacts) == [
        ("out/a.txt", 2), ("out/sub/deep/d.bin", 2), ("out/sub/r.xml", 5), ("report.xml", 5)]
    buf = io.BytesIO()
    client.artifacts(job, buf)
    with tarfile.open(fileobj=io.BytesIO(buf.getvalue())) as tar:
        skipped = {m.pax_headers["MICROVM_CHECK.skipped_name"]: m.pax_headers["MICROVM_CHECK.skipped"] for m in tar
                   if "MICROVM_CHECK.skipped" in m.pax_headers}
    assert set(skipped) == {"out/big.bin", "out/fifo", "out/link"}
    assert "larger than" in skipped["out/big.bin"] and "links are not allowed" in skipped["out/link"]


def test_timeout(vm_service) -> None:
    service, client = vm_service()
    job = submit(client, "echo going; sleep 60", timeout_seconds=3)
    assert b"going" in output(client, job)
    rec = client.get(job)
    assert (rec.state, rec.exit_code) == ("timed_out", 124)


def test_cancel_destroys_the_vm(vm_service) -> None:
    service, client = vm_service()
    job = submit(client, "echo started; sleep 120", timeout_seconds=300)
    for entry in client.logs(job):
        if entry.data == b"started\n":
            break
    rec = client.cancel(job)
    assert (rec.state, rec.exit_code) == ("cancelled", 130)
    assert client.get(job).state == "cancelled"


def test_eight_jobs_with_a_limit_of_two(vm_service) -> None:
    service, client = vm_service(max_concurrent_jobs=2, max_queued_jobs=8)
    jobs: list[str] = []
    lock = threading.Lock()

    def one(n: int) -> None:
        job = submit(client, f"echo job-{n}; sleep 1")
        with lock:
            jobs.append(job)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(jobs) == 8
    for job in jobs:
        output(client, job)
    records = [client.get(job) for job in jobs]
    assert [r.state for r in records] == ["finished"] * 8
    assert sorted(r.exit_code for r in records) == [0] * 8
    intervals = []
    for r in records:
        t = r.timings
        assert r.vm_id and None not in (t.queued_at, t.vm_ready_at, t.started_at, t.finished_at)
        intervals.append((t.vm_ready_at - t.vm_ready_ms / 1000, t.finished_at))
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak <= 2
    assert len({r.vm_id for r in records}) == 8  # one VM per job, never reused


def test_prewarmed_vm_is_used(vm_host) -> None:
    from runner.github.jobs import QueuedJob

    host = vm_host()
    service, client = host.service, JobClient(socket=host.config.socket)
    host.reactions.prewarm(QueuedJob(repository="octo/hello", run_id=4242, run_attempt=1, job_id=1, job_name="test",
                              labels=("microvm",)))
    warmed = list(service.prewarmed._vms)
    for vm in warmed:
        vm.ready.wait(120)
    assert [vm.sandbox is not None for vm in warmed] == [True]
    job = submit(client, "echo warm", run_id=4242, run_attempt=1)
    assert output(client, job) == b"warm\n"
    rec = client.get(job)
    assert rec.warm is True and rec.vm_id == warmed[0].sandbox.id


def test_sigterm_mid_job_destroys_the_vm(vm_root: Path) -> None:
    from runner.vm.sweep import processes_under

    config = vm_root / "service.yml"
    config.write_text(f"socket: {vm_root}/api.sock\nstate_dir: {vm_root}/state\nshutdown_grace_seconds: 1\n"
                      "prewarm: {max_vms: 0}\n")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from runner.cli import main; sys.exit(main(sys.argv[1:]))",
                             "serve", "--config", str(config)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        client = JobClient(socket=str(vm_root / "api.sock"))
        _wait_answering(client, proc)
        job = submit(client, "echo started; sleep 300", timeout_seconds=600)
        for entry in client.logs(job):
            if entry.data == b"started\n":
                break
        assert processes_under(vm_root / "state" / "vms") != []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rec = RecordStore(vm_root / "state" / "jobs.sqlite").get(job)
    assert rec.state == "cancelled" and "shutting down" in rec.error
    assert processes_under(vm_root / "state" / "vms") == []


def test_local_run_in_process(vm_root: Path, tmp_path: Path, monkeypatch, capfd) -> None:
    from runner.cli import main

    co = tmp_path / "co"
    co.mkdir()
    (co / "data.txt").write_text("42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MICROVM_CHECK_STATE", str(vm_root / "state"))
    status = main(["run", "--socket", str(vm_root / "none.sock"), "--dir", str(co), "--artifacts", "copy.txt",
                   "--timeout", "120", "--", "cat data.txt && cp data.txt copy.txt && exit 5"])
    assert status == 5
    assert "42" in capfd.readouterr().out
    assert (tmp_path / "artifacts" / "copy.txt").read_text() == "42\n"


def _wait_answering(client: JobClient, proc: subprocess.Popen) -> None:
    for _ in range(600):
        try:
            client.health()
            return
        except JobAPIError:
            if proc.poll() is not None:
                pytest.fail(f"serve exited early: {proc.stderr.read()}")
            time.sleep(0.05)
    pytest.fail("serve never answered on its socket")


def test_log_flood_is_truncated(vm_service) -> None:
    service, client = vm_service(logs={"max_bytes": "256KiB"})
    job = submit(client, "head -c 20000000 /dev/zero | tr '\\0' x; echo; echo done >&2", timeout_seconds=300)
    entries = list(client.logs(job))
    kept = b"".join(e.data for e in entries if e.stream in ("stdout", "stderr"))
    notes = [e.data for e in entries if e.stream == "system"]
    assert kept == b"x" * len(kept) and 128 * 1024 < len(kept) < 256 * 1024  # the budget counts bytes on disk
    assert any(b"reached the log limit of 262144 bytes on disk" in n for n in notes)
    record = client.get(job)
    assert record.state == "failed" and "the command was stopped" in record.error
    assert (service.config.jobs_dir / job / "log.ndjson").stat().st_size < 256 * 1024 + 4096


QUEUED = "github-aws-runners.workflow_job.queued.self-hosted.json"
COMPLETED = "tarantool-job-rerunner@a5e5a579.workflow_job.completed.failure.runner-tntmac06.json"


def test_webhooks_prewarm_for_the_submit_and_end_a_running_job(vm_host, tmp_path: Path) -> None:
    """Real deliveries in, real VMs out: `queued` warms the VM the submit then gets, `completed` ends a job."""
    import json
    import uuid

    import requests

    from runner.github.signature import sign

    def deliver(port: int, payload: dict) -> int:
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "X-GitHub-Event": "workflow_job",
                   "X-GitHub-Delivery": str(uuid.uuid4()), "X-Hub-Signature-256": sign(b"s3cret", body)}
        return requests.post(f"http://127.0.0.1:{port}/github/webhook", data=body, headers=headers, timeout=30).status_code

    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret")
    host = vm_host(webhook={"listen": "127.0.0.1:0", "secret_path": str(secret), "labels": ["macos-11"]})
    service, hook, client = host.service, host.webhook, JobClient(socket=host.config.socket)
    queued = captured(QUEUED)
    assert deliver(hook.port, queued) == 200
    (warm,) = list(service.prewarmed._vms)
    assert warm.ready.wait(120) and warm.sandbox is not None
    job = submit(client, "echo warm", repository=queued["repository"]["full_name"],
                 run_id=queued["workflow_job"]["run_id"], run_attempt=1)
    assert output(client, job) == b"warm\n"
    record = client.get(job)
    assert record.warm is True and record.vm_id == warm.sandbox.id

    completed = captured(COMPLETED)
    gh_job = completed["workflow_job"]
    running = submit(client, "echo started; sleep 300", repository=completed["repository"]["full_name"],
                     run_id=gh_job["run_id"], run_attempt=gh_job["run_attempt"],
                     runner_name=gh_job["runner_name"], job_name="osx", timeout_seconds=600)
    logs = client.logs(running)
    assert next(e.data for e in logs if e.stream == "stdout") == b"started\n"
    assert deliver(hook.port, completed) == 200
    for _ in logs:
        pass  # the stream ends when the job does
    assert client.get(running).state == "cancelled"  # final only once its VM is destroyed
