"""A failed job's VM kept for debugging (issue 37, docs/debugging.md), against the stand-in engine: who asks (the
repository's trusted file or the operator's config, never the pull request's checkout), the operator's bounds,
the network cut, the worker held, and a cancel, the time limit or shutdown destroying it. The real-VM proof
(attach, leftovers) is tests/e2e/test_vm_debug_keep.py."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.errors import SandboxError
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.api.attach import SessionAsk, open_terminal
from runner.service.config.reading import ConfigError, config_from_mapping
from runner.service.jobs.service import JobService, JobStateConflict
from tests.service.jobs.test_service import GitHubJob, wait_final
from tests.service.service_fakes import checkout_tar, spec

TRUSTED = "version: 1\ndebug: {keep_seconds: 600}\n"


def store(tmp_path: Path, text: str = TRUSTED, repository: str = "octo/hello") -> str:
    owner, repo = repository.split("/")
    (tmp_path / "policies" / owner).mkdir(parents=True, exist_ok=True)
    (tmp_path / "policies" / owner / f"{repo}.yml").write_text(text)
    return str(tmp_path / "policies")


def run(service: JobService, command: str, files: dict[str, bytes] | None = None, **fields) -> str:
    record = service.submit(spec(command, **fields))
    service.put_checkout(record.id, [checkout_tar(files)])
    wait_final(service, record.id)
    return record.id


def system_log(service: JobService, job: str) -> str:
    entries = [json.loads(line) for line in b"".join(service.log_of(job).follow()).splitlines()]
    return "".join(base64.b64decode(e["data"]).decode() for e in entries if e.get("stream") == "system")


def until(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def test_a_failed_jobs_vm_is_kept_cut_off_and_counted_until_its_limit(
        make_service, engine: FakeSandboxes, tmp_path: Path) -> None:
    engine.programs.update({"bad": prints(b"oops\n", 3), "ok": prints(b"fine\n")})
    service = make_service(policy_dir=store(tmp_path), max_concurrent_jobs=1, debug={"max_keep_seconds": 2})
    job = run(service, "bad")
    record = service.get(job)
    assert record.state == "finished" and record.exit_code == 3
    assert record.error and "kept for 2 s" in record.error and f"microvm-check jobs attach {job}" in record.error
    assert "its network cut to nothing" in system_log(service, job)
    vm = engine.created[0]
    assert vm.alive and vm.network_cut and vm.request.ttl_seconds >= 2 + 600
    # out of the active runs (a GitHub job's end or its runner's death cancels those), still attachable
    assert job not in [run.record.id for run in service.runs.all()] and service.run_of(job).sandbox is vm
    with pytest.raises(SandboxError, match="a fake sandbox has no terminal"):  # past the state check
        open_terminal(service.run_of(job), SessionAsk(["true"], (24, 80)))
    later = service.submit(spec("ok"))
    service.put_checkout(later.id, [checkout_tar()])
    time.sleep(0.5)
    assert service.get(later.id).state == "queued", "the kept VM's worker ran another job"
    wait_final(service, later.id)
    assert not vm.alive and service.get(later.id).vm_id != vm.id
    with pytest.raises(JobStateConflict, match="only a running job"):
        service.run_of(job)
    assert service.get(job).error == record.error


def test_a_passing_job_and_a_cancelled_one_are_not_kept(make_service, engine: FakeSandboxes, tmp_path: Path) -> None:
    engine.programs.update({"ok": prints(b"fine\n")})
    service = make_service(policy_dir=store(tmp_path))
    job = run(service, "ok")
    assert service.get(job).error is None and not engine.created[0].alive


def test_a_cancel_ends_the_keep_and_leaves_the_record(make_service, engine: FakeSandboxes, tmp_path: Path) -> None:
    engine.programs.update({"bad": prints(b"oops\n", 1)})
    service = make_service(policy_dir=store(tmp_path), debug={"max_keep_seconds": 600, "cut_network": False})
    job = run(service, "bad")
    vm = engine.created[0]
    assert vm.alive and not vm.network_cut and "its network as the job had it" in (service.get(job).error or "")
    before = service.get(job).to_wire()
    service.cancel(job)
    assert not vm.alive, "cancel returned before the kept VM was destroyed"
    assert service.get(job).to_wire() == before


def test_the_github_jobs_end_leaves_the_keep_to_its_time(make_host, engine: FakeSandboxes, tmp_path: Path) -> None:
    """The completed webhook cancels what still runs for the GitHub job; a kept VM runs nothing of it."""
    engine.programs.update({"bad": prints(b"oops\n", 1)})
    host = make_host(policy_dir=store(tmp_path), debug={"max_keep_seconds": 600})
    job = run(host.service, "bad", run_id=91, run_attempt=1)
    host.reactions.job_completed(GitHubJob(job_id=601, run_id=91))
    assert engine.created[0].alive and host.service.run_of(job).debug_until is not None
    host.service.cancel(job)
    assert not engine.created[0].alive


def test_shutdown_destroys_a_kept_vm(hosts, engine: FakeSandboxes, tmp_path: Path) -> None:
    engine.programs.update({"bad": prints(b"oops\n", 1)})
    host = hosts(serve_api=False, policy_dir=store(tmp_path), debug={"max_keep_seconds": 600})
    run(host.service, "bad")
    assert engine.created[0].alive
    host.service.close()
    assert not engine.created[0].alive


def test_the_operators_config_alone_keeps_and_bounds(make_service, engine: FakeSandboxes) -> None:
    engine.programs.update({"bad": prints(b"oops\n", 1)})
    service = make_service(debug={"keep_seconds": 900, "max_keep_seconds": 1})
    job = run(service, "bad")
    assert "kept for 1 s" in (service.get(job).error or "")
    until(lambda: not engine.created[0].alive)


def test_a_pull_requests_own_file_keeps_nothing_and_its_log_says_why(
        make_service, engine: FakeSandboxes, tmp_path: Path) -> None:
    engine.programs.update({"bad": prints(b"oops\n", 1)})
    service = make_service(policy_dir=store(tmp_path, "version: 1\n"))
    job = run(service, "bad", {".github/microvm-check.yml": b"version: 1\ndebug: true\n", "README": b"x\n"})
    assert not engine.created[0].alive and "kept" not in (service.get(job).error or "")
    assert "that copy is the pull request's, which cannot keep a VM" in system_log(service, job)


def test_the_operator_can_refuse_what_a_repository_asks(make_service, engine: FakeSandboxes, tmp_path: Path) -> None:
    engine.programs.update({"bad": prints(b"oops\n", 1)})
    service = make_service(policy_dir=store(tmp_path), debug={"allowed": False})
    job = run(service, "bad", {".github/microvm-check.yml": b"debug: true\n"})
    assert not engine.created[0].alive
    assert "does not allow keeping VMs (debug.allowed: false)" in system_log(service, job)


@pytest.mark.parametrize("section, message", [
    ({"max_keep_seconds": -1}, "debug.max_keep_seconds: must be at least 0"),
    ({"max_keep_seconds": 86401}, "debug.max_keep_seconds: must be at most 86400"),
    ({"allowed": "yes please"}, "debug.allowed"),
    ({"keep": 5}, "debug"),
])
def test_the_config_section_is_checked(tmp_path: Path, section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        config_from_mapping({"state_dir": str(tmp_path), "debug": section})


def test_the_config_section_defaults() -> None:
    debug = config_from_mapping({}).debug
    assert (debug.allowed, debug.max_keep_seconds, debug.keep_seconds, debug.cut_network) == (True, 900, 0, True)
