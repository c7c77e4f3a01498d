"""`microvm-check run` on real VMs: without a service it restores exactly one VM, and a run stopped by
SIGTERM, SIGINT or SIGHUP (a closed terminal) cancels its job and leaves nothing behind: no temporary
directory, no VM process, no job running (issues 26, 20).

Each run is the installed command in its own process, with TMPDIR pointing at a directory of the test's
own, so that what a run leaves in it is seen, and nothing of another run is mistaken for it.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import JobState
from runner.vm.sweep import processes_under
from tests.e2e.vm_jobs import templates  # noqa: F401 (fixture)

pytestmark = pytest.mark.vm

CLI = str(Path(sys.executable).parent / "microvm-check")
STARTED = b"job-command-started"


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    co = tmp_path / "co"
    co.mkdir()
    (co / "README").write_text("a checkout\n")
    return co


def _start_run(socket: Path, checkout: Path, tmpdir: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROVM_CHECK")} | {"TMPDIR": str(tmpdir)}
    return subprocess.Popen([CLI, "run", "--socket", str(socket), "--", "sh", "-c",
                             f"echo {STARTED.decode()}; sleep 120"],
                            cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def _wait_for_command(proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    """Until the guest's command has printed its first line (so the job is running in its VM)."""
    assert proc.stdout is not None
    seen, deadline = b"", time.monotonic() + timeout
    while STARTED not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"the job did not start: {seen!r} {proc.stderr.read() if proc.stderr else ''}"
        if select.select([proc.stdout], [], [], min(left, 1.0))[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, f"the run's output ended: {seen!r}"
            seen += chunk


def _stop(proc: subprocess.Popen[bytes], signum: int) -> tuple[int, str]:
    proc.send_signal(signum)
    try:
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err.decode(errors="replace")


def _vm_dirs(engine_root: Path) -> list[str]:
    vms = engine_root / "vms"
    return sorted(p.name for p in vms.iterdir() if not p.name.startswith(".")) if vms.is_dir() else []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_run_without_a_service_restores_one_vm_and_a_signal_leaves_nothing(
        signum: signal.Signals, templates: Path, checkout: Path, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc = _start_run(tmp_path / "nobody.sock", checkout, tmpdir)
    try:
        _wait_for_command(proc)
        (run_dir,) = tmpdir.glob("mvc-run-*")
        time.sleep(1.0)  # a spare pool, if there were one, would be filling now
        assert len(_vm_dirs(run_dir / "engine")) == 1, "a run without a service restores exactly its job's VM"
        assert len({pid for pid in processes_under(run_dir / "engine" / "vms")}) >= 1
    finally:
        code, err = _stop(proc, signum)
    assert code == 128 + signum, err
    assert "Traceback" not in err and "cancelled job" in err, err
    assert list(tmpdir.iterdir()) == [], "the run's temporary directory is left behind"
    assert processes_under(run_dir) == [], "a VM process of the run outlived it"


def test_a_run_on_a_socket_nobody_serves_runs_in_its_own_service(templates: Path, checkout: Path,
                                                                  tmp_path: Path) -> None:
    """A socket file left by a dead service: the submit cannot connect (nothing sent), so the run falls back."""
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stale))
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROVM_CHECK")} | {"TMPDIR": str(tmpdir)}
    done = subprocess.run([CLI, "run", "--socket", str(stale), "--", "sh", "-c", "echo in-the-vm"], cwd=checkout,
                          env=env, capture_output=True, timeout=300)
    assert done.returncode == 0 and done.stdout == b"in-the-vm\n", done.stderr.decode(errors="replace")
    assert list(tmpdir.iterdir()) == []


@pytest.fixture
def served(templates: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """`microvm-check serve` on a private socket and state directory (the templates shared): (socket, state)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "templates").symlink_to(templates)
    socket = tmp_path / "api.sock"
    config = tmp_path / "service.yml"
    config.write_text(f"socket: {socket}\nstate_dir: {state}\ntemplates: [base]\nmax_concurrent_jobs: 1\n")
    proc = subprocess.Popen([CLI, "serve", "--config", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with JobClient(socket=str(socket)) as client:
                    client.health()
                break
            except JobAPIError:
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.2)
        yield socket, state
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert processes_under(state / "vms") == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_run_through_the_service_stopped_by_a_signal_cancels_its_job(
        signum: signal.Signals, served: tuple[Path, Path], checkout: Path, tmp_path: Path) -> None:
    socket, _state = served
    proc = _start_run(socket, checkout, tmp_path)
    try:
        _wait_for_command(proc)
    finally:
        code, err = _stop(proc, signum)
    assert code == 128 + signum, err
    with JobClient(socket=str(socket)) as client:
        (record,) = client.list(1)
        deadline = time.monotonic() + 60
        while not record.final and time.monotonic() < deadline:  # final only once its VM is destroyed
            time.sleep(0.2)
            record = client.get(record.id)
    assert record.state == JobState.CANCELLED, record
