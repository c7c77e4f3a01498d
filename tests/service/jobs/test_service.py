"""The service's own logic against a stand-in engine: every path ends in a final record and a destroyed VM."""

from __future__ import annotations

import base64
import io
import json
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from runner.attest.keys import SigningKey
from runner.sandbox.fake import FakeSandboxes, floods, prints, waits
from runner.service.api.refusals import status_of
from runner.service.host.assembly import ServiceHost
from runner.service.host.binding import access_for
from runner.service.jobs.admission import InvalidJob, TooLarge
from runner.service.jobs.attestation import JobAttestor
from runner.service.jobs.jobqueue import QueueFull
from runner.service.jobs.parts import job_parts
from runner.service.jobs.records import RecordStore
from runner.service.jobs.service import JobNotFound, JobService, JobStateConflict
from runner.service.jobs.workers import JobVMs
from tests.service.service_fakes import checkout_tar, member, spec, tar_of


def run(service: JobService, command: str, **fields) -> str:
    record = service.submit(spec(command, **fields))
    service.put_checkout(record.id, [checkout_tar()])
    return record.id


def wait_started(service: JobService, job_id: str):
    """Follow the log until the guest program has written "started"; returns the rest of the stream."""
    follow = service.log_of(job_id).follow()
    for line in follow:
        if base64.b64decode(json.loads(line)["data"]) == b"started\n":
            return follow
    raise AssertionError(f"job {job_id} ended before its command started")


def wait_final(service: JobService, job_id: str) -> None:
    for _ in service.log_of(job_id).follow():
        pass


def test_success_and_failure_exit_codes(make_service: Callable[..., JobService], engine: FakeSandboxes) -> None:
    engine.programs.update({"ok": prints(b"fine\n", 0), "bad": prints(b"oops\n", 3)})
    service = make_service()
    ok, bad = run(service, "ok"), run(service, "bad")
    wait_final(service, ok)
    wait_final(service, bad)
    assert (service.get(ok).state, service.get(ok).exit_code) == ("finished", 0)
    assert (service.get(bad).state, service.get(bad).exit_code) == ("finished", 3)
    assert engine.alive() == []
    sbx = engine.created[0]
    assert sbx.files == {"/workspace/README": b"hello\n"}
    call = sbx.exec_calls[0]
    assert call["cwd"] == "/workspace" and call["env"]["CI"] == "true"
    rec = service.get(ok)
    assert [b.to_wire() for b in rec.blocked_egress] == [
        {"dest": "192.0.2.7", "port": 443, "proto": "tcp", "name": "blocked.example", "count": 2, "reason": "policy"},
        {"dest": "198.51.100.1", "port": None, "proto": "icmp", "name": None, "count": 1, "reason": "policy"}]
    assert rec.policy_digest.startswith("sha256:")
    t = rec.timings
    assert t.queued_at <= t.vm_ready_at <= t.started_at <= t.finished_at
    assert not (service.config.jobs_dir / ok / "checkout.tar").exists()


def test_command_runs_in_the_working_directory_with_the_env(make_service, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    service = make_service()
    job = run(service, "ok", working_directory="sub/dir", env={"GITHUB_SHA": "abc"}, timeout_seconds=42)
    wait_final(service, job)
    call = engine.created[0].exec_calls[0]
    assert call["cwd"] == "/workspace/sub/dir"
    assert call["env"]["GITHUB_SHA"] == "abc" and call["timeout"] == 42
    assert engine.created[0].request.ttl_seconds > 42


def test_timeout(make_service, engine: FakeSandboxes) -> None:
    engine.programs["sleep"] = waits()
    service = make_service()
    job = run(service, "sleep", timeout_seconds=1)
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, rec.exit_code) == ("timed_out", 124)
    assert engine.alive() == []


def test_cancel_running_destroys_the_vm(make_service, engine: FakeSandboxes) -> None:
    engine.programs["sleep"] = waits()
    service = make_service()
    job = run(service, "sleep", timeout_seconds=600)
    follow = wait_started(service, job)
    service.cancel(job)
    list(follow)
    rec = service.get(job)
    assert (rec.state, rec.exit_code, rec.error) == ("cancelled", 130, "cancelled by the client")
    assert engine.alive() == []
    assert service.cancel(job).state == "cancelled"  # idempotent


def test_cancel_before_checkout_and_while_queued(make_service, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs.update({"block": waits(release), "ok": prints(b"")})
    service = make_service(max_concurrent_jobs=1)
    first = run(service, "block", timeout_seconds=600)
    queued = run(service, "ok")
    waiting = service.submit(spec("ok")).id
    assert service.cancel(queued).state == "cancelled"
    assert service.cancel(waiting).state == "cancelled"
    with pytest.raises(JobStateConflict, match=r"^job j[0-9a-f]+ has already ended$") as err:
        service.put_checkout(waiting, [checkout_tar()])
    assert status_of(err.value) == 409
    release.set()
    wait_final(service, first)
    assert service.get(first).state == "finished"
    assert len(engine.created) == 1  # the cancelled jobs never got a VM


def test_cancel_during_the_upload_leaves_no_checkout_behind(make_service, make_config) -> None:
    service = make_service()
    job = service.submit(spec("ok")).id

    def chunks():
        yield checkout_tar()
        service.cancel(job)  # the job's clean-up runs while the upload is still open

    with pytest.raises(JobStateConflict, match="was cancelled while its checkout was uploading") as err:
        service.put_checkout(job, chunks())
    assert status_of(err.value) == 409
    assert list((service.config.jobs_dir / job).glob("checkout*")) == []


def test_a_submit_that_fails_after_reserving_gives_its_place_back(make_service, monkeypatch) -> None:
    service = make_service(max_queued_jobs=1)

    def broken_log(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr("runner.service.jobs.service.JobLog", broken_log)
    for _ in range(2):  # the second would be QueueFull if the first had kept its reservation
        with pytest.raises(OSError, match="Too many open files"):
            service.submit(spec("ok"))
    assert list(service.config.jobs_dir.iterdir()) == []


def test_log_flood_is_bounded(make_service, engine: FakeSandboxes) -> None:
    engine.programs["flood"] = floods(8 * 1024 * 1024)
    service = make_service(logs={"max_bytes": "64KiB"})
    job = run(service, "flood")
    wait_final(service, job)
    record = service.get(job)
    assert (record.state, record.exit_code) == ("failed", None)
    assert "reached the log limit of 65536 bytes on disk" in record.error
    assert engine.created[0].destroyed.is_set()
    assert (service.config.jobs_dir / job / "log.ndjson").stat().st_size < 64 * 1024 + 1024


def test_artifacts_are_validated(make_service, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    engine.artifacts_tar = tar_of([(member("dist/a.whl"), b"wheel")])
    service = make_service()
    job = run(service, "ok", artifacts=["dist/*.whl"])
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, [a.to_wire() for a in rec.artifacts]) == ("finished", [{"path": "dist/a.whl", "size": 5}])
    assert engine.created[0].get_tar_calls == [(["dist/*.whl"], "/workspace")]
    with tarfile.open(service.artifacts_path(job)) as tar:
        assert tar.extractfile("dist/a.whl").read() == b"wheel"


def system_log(service, job: str) -> str:
    lines = (service.config.jobs_dir / job / "log.ndjson").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    return "\n".join(base64.b64decode(e["data"]).decode() for e in entries if e["stream"] == "system")


def test_hostile_artifacts_are_skipped_and_named_and_the_job_keeps_its_result(make_service, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"made a link\n", 0)
    engine.artifacts_tar = tar_of([(member("ok"), b"1"),
                                   (member("evil", tarfile.SYMTYPE, "/etc/shadow"), None),
                                   (member(".git/hooks/post-checkout"), b"#!/bin/sh\n")])
    service = make_service()
    job = run(service, "ok", artifacts=["*"])
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, rec.exit_code, rec.error) == ("finished", 0, None)
    assert [a.to_wire() for a in rec.artifacts] == [{"path": "ok", "size": 1}]
    log = system_log(service, job)
    assert "artifact evil skipped: links are not allowed" in log
    assert "artifact .git/hooks/post-checkout skipped: a .git path component" in log
    with tarfile.open(service.artifacts_path(job)) as tar:
        names = [(m.name, m.pax_headers.get("MICROVM_CHECK.skipped_name")) for m in tar]  # the last two as notes
        assert names == [("ok", None), (".microvm-check-skipped/1", "evil"),
                         (".microvm-check-skipped/2", ".git/hooks/post-checkout")]
        assert tar.extractfile("ok").read() == b"1"


def test_engine_failure_fails_the_job_cleanly(make_service, engine: FakeSandboxes) -> None:
    engine.fail_create = True
    service = make_service()
    job = run(service, "ok")
    wait_final(service, job)
    rec = service.get(job)
    assert rec.state == "failed" and "could not be restored" in rec.error


def test_concurrency_limit_and_nothing_lost(make_service, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs["work"] = waits(release)
    service = make_service(max_concurrent_jobs=2, max_queued_jobs=8)
    jobs = [run(service, "work", timeout_seconds=600) for _ in range(8)]
    with pytest.raises(QueueFull, match=r"^the job queue is full \(8 jobs waiting\); retry in \d+ s$"):
        for _ in range(9):  # the 8 submitted jobs minus those already taken by workers, then full
            service.submit(spec("work"))
    release.set()
    for job in jobs:
        wait_final(service, job)
    assert engine.max_live == 2
    assert [service.get(j).state for j in jobs] == ["finished"] * 8


def test_bad_checkout_is_refused(make_service) -> None:
    service = make_service(checkout_max_bytes="16KiB")
    job = service.submit(spec()).id
    with pytest.raises(TooLarge, match="the checkout is larger than the service's limit of 16384 bytes; leave build outputs out") as err:
        service.put_checkout(job, [b"\0" * 10000, b"\0" * 10000])
    assert status_of(err.value) == 413
    with pytest.raises(InvalidJob, match="^checkout: not a valid tar archive: the stream ended inside a tar header$") as err:
        service.put_checkout(job, [b"not a tar" * 10])
    assert status_of(err.value) == 400
    service.put_checkout(job, [checkout_tar()])  # the job is still waiting for a good one


def test_shutdown_cancels_running_and_queued_and_destroys_vms(make_service, engine: FakeSandboxes) -> None:
    engine.programs["sleep"] = waits()
    service = make_service(max_concurrent_jobs=1)
    running = run(service, "sleep", timeout_seconds=600)
    wait_started(service, running)
    queued = run(service, "sleep", timeout_seconds=600)
    waiting = service.submit(spec("sleep")).id
    service.drain(grace_seconds=0)
    store = RecordStore(service.config.records_path)
    assert store.get(running).state == "cancelled"
    assert store.get(queued).state == "cancelled"
    assert store.get(waiting).state == "cancelled"
    assert engine.alive() == []


def test_restart_fails_leftovers_and_sweeps_orphans(make_config, engine: FakeSandboxes) -> None:
    config = make_config()
    crashed = JobService(config, job_parts(config, JobVMs(engine.create, None), access=access_for(config),
                                           attestor=JobAttestor(SigningKey.load_or_create(config.attestation_key_path))))
    job = crashed.submit(spec()).id
    crashed.put_checkout(job, [checkout_tar()])  # queued, never run: no workers were started
    orphan = config.jobs_dir / "j00000000000000ff"
    orphan.mkdir()
    (orphan / "junk").write_bytes(b"x")
    crashed.records.close()
    with ServiceHost(config, sandboxes=engine.create, serve_api=False) as host:
        assert host.service is not None
        rec = host.service.get(job)
        assert rec.state == "failed" and "service stopped" in rec.error
        assert not orphan.exists()
        assert not (config.jobs_dir / job / "checkout.tar").exists()


@dataclass(frozen=True)
class GitHubJob:  # the fields of runner.github.jobs.QueuedJob / CompletedJob the hooks read
    repository: str = "octo/hello"
    run_id: int = 77
    run_attempt: int = 1
    job_id: int = 501
    job_name: str = "test"
    labels: tuple[str, ...] = ("microvm",)
    conclusion: str | None = "cancelled"
    runner_name: str | None = None


def test_prewarmed_vm_is_claimed_by_the_matching_submit(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    host.reactions.prewarm(GitHubJob())
    warm_vm = _wait_warm(service, engine)
    other = run(service, "ok", run_id=78, run_attempt=1)
    job = run(service, "ok", run_id=77, run_attempt=1)
    wait_final(service, other)
    wait_final(service, job)
    rec = service.get(job)
    assert rec.warm is True and rec.vm_id == warm_vm.id
    assert service.get(other).warm is False
    assert engine.alive() == []


def test_job_completed_discards_warm_vm_and_cancels_running(make_host, engine: FakeSandboxes) -> None:
    engine.programs["sleep"] = waits()
    host = make_host()
    service = host.service
    host.reactions.prewarm(GitHubJob(job_id=600, run_id=90))
    warm_vm = _wait_warm(service, engine)
    host.reactions.job_completed(GitHubJob(job_id=600, run_id=90))
    assert warm_vm.destroyed.is_set() and service.prewarmed.count() == 0
    job = run(service, "sleep", run_id=91, run_attempt=1, timeout_seconds=600)
    follow = wait_started(service, job)
    host.reactions.job_completed(GitHubJob(job_id=601, run_id=91))
    list(follow)
    assert service.get(job).state == "cancelled"
    assert engine.alive() == []


def test_job_completed_matches_by_runner_when_names_differ(make_host, engine: FakeSandboxes) -> None:
    engine.programs["sleep"] = waits()
    host = make_host()
    service = host.service
    other = run(service, "sleep", run_id=92, run_attempt=1, timeout_seconds=600, job_name="build", runner_name="host-b")
    job = run(service, "sleep", run_id=92, run_attempt=1, timeout_seconds=600, job_name="build", runner_name="host-a")
    follow = wait_started(service, job)
    wait_started(service, other)
    host.reactions.job_completed(GitHubJob(job_id=602, run_id=92, job_name="build (3.11)", runner_name="host-a"))
    list(follow)
    assert service.get(job).state == "cancelled"
    assert service.get(other).state == "running"
    service.cancel(other)
    wait_final(service, other)
    assert engine.alive() == []


def test_unclaimed_warm_vms_expire(make_host, engine: FakeSandboxes) -> None:
    host = make_host(prewarm={"max_vms": 1, "expire_seconds": 1})
    service = host.service
    host.reactions.prewarm(GitHubJob(job_id=1))
    host.reactions.prewarm(GitHubJob(job_id=2))  # over the bound: ignored
    warm_vm = _wait_warm(service, engine)
    assert len(engine.created) == 1
    service.prewarmed._clock = lambda: float("inf")
    host.retention.reap()
    assert warm_vm.destroyed.is_set()


def test_checkout_that_never_comes_expires(make_host) -> None:
    host = make_host(checkout_wait_seconds=5)
    service = host.service
    job = service.submit(spec()).id
    host.retention.reap(now=service.get(job).created_at + 6)
    rec = service.get(job)
    assert rec.state == "failed" and "no checkout" in rec.error


def test_retention_prunes_records_and_dirs(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host(retention={"days": 1, "max_records": 100})
    service = host.service
    job = run(service, "ok")
    wait_final(service, job)
    assert host.retention.prune(now=service.get(job).created_at + 2 * 86400) == [job]
    assert not (service.config.jobs_dir / job).exists()
    with pytest.raises(JobNotFound, match=r"^no job 'j[0-9a-f]+' \(records are kept 1 days\)$") as err:
        service.get(job)
    assert status_of(err.value) == 404


def _wait_warm(service: JobService, engine: FakeSandboxes):
    for vm in service.prewarmed._vms:
        vm.ready.wait(10)
    return engine.created[-1]


def test_artifact_tar_streams_from_disk(make_service, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    engine.artifacts_tar = tar_of([(member(f"f{i}"), bytes([i]) * 1000) for i in range(20)])
    service = make_service()
    job = run(service, "ok", artifacts=["f*"])
    wait_final(service, job)
    with tarfile.open(fileobj=io.BytesIO(service.artifacts_path(job).read_bytes())) as tar:
        assert len(tar.getnames()) == 20


def test_no_matching_artifacts_is_not_an_error(make_service, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    service = make_service()
    job = run(service, "ok", artifacts=["nothing/*"], working_directory="sub")
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, rec.exit_code, rec.artifacts) == ("finished", 0, [])
    assert engine.created[0].get_tar_calls == [(["nothing/*"], "/workspace/sub")]


def test_oversized_artifacts_keep_the_exit_code(make_service, engine: FakeSandboxes) -> None:
    engine.programs["bad"] = prints(b"", 1)
    engine.artifacts_tar = tar_of([(member("big"), b"\0" * 200000)])
    service = make_service(artifacts={"max_count": 2, "max_total_bytes": "64KiB"})
    job = run(service, "bad", artifacts=["big"])
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, rec.exit_code, rec.artifacts) == ("finished", 1, [])
    assert "artifact transfer ended early" in system_log(service, job)


def test_a_dead_prewarmed_vm_is_replaced(make_host, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    host.reactions.prewarm(GitHubJob(run_id=99))
    warm_vm = _wait_warm(service, engine)
    warm_vm.destroyed.set()  # the engine's reaper killed it (TTL, crash) before the submit came
    with engine.lock:
        engine.live -= 1
    job = run(service, "ok", run_id=99, run_attempt=1)
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, rec.warm) == ("finished", False)
    assert rec.vm_id != warm_vm.id
