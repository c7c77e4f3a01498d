"""A failed job's VM kept for debugging through a real `serve` and the real CLI (issue 37, docs/debugging.md).

The repository's trusted file (the operator's store) asks for `debug:`; the operator's config bounds it
to 20 s. The failed job's record is final with its VM alive: the result and the log say how long it is
kept and how to attach, `jobs exec` sees the job's files, the kept VM holds the only worker (a second job
waits), then at the limit it is destroyed and leaves nothing (no VMM, no VM directory, no cgroup). The
second job, of a repository whose trusted side asks for nothing but whose own checkout carries a
`.github/microvm-check.yml` with `debug:`, keeps no VM and its log says why. A cancel ends a keep
sooner. Needs root, QEMU and the built `base` template: failing under CI=true.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.jobapi.client import JobClient
from runner.vm import cgroup
from runner.vm.sweep import processes_under
from tests.e2e.test_vm_e2e_serve import serve  # noqa: F401 (fixture)
from tests.e2e.vm_jobs import submit, templates, vm_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vm
CLI = str(Path(sys.executable).parent / "microvm-check")
WAIT_S = 300.0  # hang guards, never measures
KEEP_S = 20
FAILS = "echo made > /workspace/made.txt; exit 3"


def config(vm_root: Path) -> dict[str, object]:
    store = vm_root / "policies"
    (store / "octo").mkdir(parents=True)
    (store / "octo" / "hello.yml").write_text("version: 1\ndebug: {keep_seconds: 600}\n")  # the config caps it
    return {"policy_dir": str(store), "max_concurrent_jobs": 1, "debug": {"max_keep_seconds": KEEP_S}}


def cli(sock: Path, *args: str, command: tuple[str, ...] = ()) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([CLI, *args, "--socket", str(sock), *(["--", *command] if command else [])],
                          capture_output=True, timeout=WAIT_S, stdin=subprocess.DEVNULL)


def ended(client: JobClient, job: str) -> None:
    for _ in client.logs(job, follow=True):
        pass


def system_log(client: JobClient, job: str) -> str:
    return "".join(e.data.decode(errors="replace") for e in client.logs(job) if e.stream == "system")


def gone(vm_root: Path, vm_id: str, within: float) -> float:
    """Seconds until VM `vm_id`'s directory and VMM are gone (a failure past `within`)."""
    begun = time.monotonic()
    vm_dir = vm_root / "state" / "vms" / vm_id
    while vm_dir.exists() or processes_under(vm_dir):
        assert time.monotonic() - begun < within, f"kept VM {vm_id} outlived its keep"
        time.sleep(0.2)
    return time.monotonic() - begun


def no_cgroup(vm_root: Path, vm_id: str) -> None:
    """VM `vm_id`'s cgroup is gone (the engine's spare VMs keep theirs)."""
    deadline = time.monotonic() + 30
    while any(g.name == vm_id for g in cgroup.groups(cgroup.scope_for(vm_root / "state" / "vms"))):
        assert time.monotonic() < deadline, f"VM {vm_id}'s cgroup was left behind"
        time.sleep(0.2)


def test_a_failed_jobs_vm_is_kept_attachable_then_destroyed_and_a_pull_request_cannot_ask(serve, vm_root: Path) -> None:
    sock = vm_root / "api.sock"
    service = serve(config(vm_root))
    operator = JobClient(socket=str(sock))
    service.wait_answering(operator)

    job = submit(operator, FAILS, timeout_seconds=600)
    ended(operator, job)
    record = operator.get(job)
    kept_at = time.monotonic()
    assert record.state.value == "finished" and record.exit_code == 3, record
    assert record.error and f"kept for {KEEP_S} s" in record.error and f"microvm-check jobs attach {job}" in record.error
    assert f"kept for {KEEP_S} s" in system_log(operator, job)
    vm_id = record.vm_id
    assert vm_id and (vm_root / "state" / "vms" / vm_id).is_dir(), "the failed job's VM is gone"

    seen = cli(sock, "jobs", "exec", job, command=("sh", "-c", "cat /workspace/made.txt /workspace/README"))
    assert seen.returncode == 0 and b"made" in seen.stdout and b"hello" in seen.stdout, seen

    # the kept VM holds the only worker: the pull request's job waits for it
    asks = submit(operator, "exit 1", files={"README": b"hi\n", ".github/microvm-check.yml":
                                             b"version: 1\ndebug: {keep_seconds: 900}\n"},
                  repository="octo/other", timeout_seconds=600)
    time.sleep(3)
    assert operator.get(asks).state.value == "queued", "a job started while the kept VM held the only worker"

    gone(vm_root, vm_id, KEEP_S + 30)
    no_cgroup(vm_root, vm_id)
    assert time.monotonic() - kept_at >= KEEP_S - 2, f"the kept VM went after {time.monotonic() - kept_at:.0f} s"
    refused = cli(sock, "jobs", "exec", job, command=("true",))
    assert refused.returncode != 0 and b"409" in refused.stderr, refused

    ended(operator, asks)
    other = operator.get(asks)
    assert other.state.value == "finished" and other.exit_code == 1 and other.vm_id != vm_id, other
    assert "kept for" not in (other.error or "")
    text = system_log(operator, asks)
    assert "that copy is the pull request's, which cannot keep a VM" in text, text
    gone(vm_root, other.vm_id or "", 30)
    no_cgroup(vm_root, other.vm_id or "")


def test_a_cancel_or_the_services_stop_ends_a_keep_sooner(serve, vm_root: Path) -> None:
    sock = vm_root / "api.sock"
    service = serve(config(vm_root) | {"debug": {"max_keep_seconds": 600}})
    operator = JobClient(socket=str(sock))
    service.wait_answering(operator)

    job = submit(operator, "sleep 30", timeout_seconds=2)  # timed out: kept as well
    ended(operator, job)
    record = operator.get(job)
    assert record.state.value == "timed_out" and record.error and "kept for 600 s" in record.error, record
    assert record.vm_id and (vm_root / "state" / "vms" / record.vm_id).is_dir()

    cancelled = cli(sock, "jobs", "cancel", job)
    assert cancelled.returncode == 0, cancelled
    assert gone(vm_root, record.vm_id, 10) < 10
    no_cgroup(vm_root, record.vm_id)
    assert operator.get(job).state.value == "timed_out", "a cancel rewrote the final record"

    again = submit(operator, "exit 1", timeout_seconds=600)
    ended(operator, again)
    kept = operator.get(again)
    assert kept.vm_id and "kept for 600 s" in (kept.error or "")
    begun = time.monotonic()
    assert service.stop() == 0
    assert time.monotonic() - begun < 60, "the service's stop waited for the keep"
    gone(vm_root, kept.vm_id, 10)
    no_cgroup(vm_root, kept.vm_id)
