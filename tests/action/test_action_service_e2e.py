"""The action end to end against the real job service over its real Unix socket.

action.yml runs as the GitHub runner would run it (action_harness), the service is the real
JobService + API server; only the VM is replaced by a local stand-in (local_sandbox), so these run
everywhere. The same scenarios against real VMs, plus the hostile guest, are in test_action_vm_e2e.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.jobapi.client import JobClient
from runner.service.config.reading import config_from_mapping
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.service import JobService
from tests.action.action_harness import (
    FORK_PR,
    HOST_SECRETS,
    PYTHON,
    Simulation,
    assert_only_action_commands,
    finish,
    interrupt,
    run_action,
    start,
    wait_for_state,
)
from tests.action.local_sandbox import LocalEngine
from tests.reference import captured

TESTS = '''
import os

def test_one():
    assert True

def test_two():
    assert os.environ.get("SHOULD_FAIL") != "1", "asked to fail"
'''


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mvc-act-", dir="/tmp"))  # Unix socket paths stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine() -> LocalEngine:
    return LocalEngine()


@pytest.fixture
def service(short_dir: Path, engine: LocalEngine) -> Iterator[JobService]:
    config = config_from_mapping({"socket": str(short_dir / "api.sock"), "state_dir": str(short_dir / "state"),
                                  "env_allowlist": ["CI", "GITHUB_*", "RUNNER_*", "SHOULD_FAIL"],
                                  "shutdown_grace_seconds": 0})
    try:
        with ServiceHost(config, sandboxes=engine.create) as host:
            assert host.service is not None
            yield host.service
    finally:
        for sandbox in engine.created:
            sandbox.destroy()


@pytest.fixture
def sim(tmp_path: Path) -> Simulation:
    workspace = tmp_path / "workspace"
    (workspace / "sub" / "tests").mkdir(parents=True)
    (workspace / "sub" / "tests" / "test_sample.py").write_text(TESTS)
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    payload = captured(FORK_PR)
    return Simulation(workspace=workspace, temp=temp, event_payload=payload)


def pytest_inputs(service: JobService, **more: str) -> dict[str, str]:
    return {
        "run": f"{PYTHON} -m pytest -q -p no:cacheprovider --junitxml=out/report.xml tests",
        "working-directory": "sub",
        "artifacts": "out/*.xml",
        "socket": service.config.socket,
        **more,
    }


def test_passing_suite(service: JobService, sim: Simulation) -> None:
    result = run_action(sim, pytest_inputs(service))
    assert result.returncode == 0, result.log
    assert result.outputs["exit-code"] == "0"
    assert (result.outputs["junit-passed"], result.outputs["junit-failed"]) == ("2", "0")
    record = json.loads(result.outputs["result-json"])["record"]
    assert record["state"] == "finished"
    pull = sim.event_payload["pull_request"]
    assert record["sha"] == pull["head"]["sha"] and record["repository"] == pull["base"]["repo"]["full_name"]
    assert (sim.workspace / "artifacts" / "out" / "report.xml").is_file()
    assert "2 passed" in result.log and "::stop-commands::" in result.log
    assert "2 passed, 0 failed, 0 skipped" in result.summary


def test_failing_suite(service: JobService, sim: Simulation) -> None:
    sim.extra_env["SHOULD_FAIL"] = "1"
    result = run_action(sim, pytest_inputs(service, env="SHOULD_FAIL"))
    assert result.returncode == 1
    assert result.outputs["exit-code"] == "1"
    assert (result.outputs["junit-passed"], result.outputs["junit-failed"]) == ("1", "1")
    annotations = [line for line in result.log.splitlines() if line.startswith("::error ")]
    assert any(line.startswith("::error file=sub/tests/test_sample.py,line=8,title=tests.test_sample.test_two::")
               for line in annotations), annotations
    assert "test_two" in result.summary and "❌" in result.summary


def test_timeout(service: JobService, sim: Simulation) -> None:
    result = run_action(sim, {"run": "echo begin; sleep 120", "timeout-minutes": "0.05",
                              "socket": service.config.socket})
    assert result.returncode == 124
    assert result.outputs["exit-code"] == "124"
    assert json.loads(result.outputs["result-json"])["record"]["state"] == "timed_out"
    assert "::error::job timed out" in result.log


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_cancel(service: JobService, sim: Simulation, engine: LocalEngine, signum: int) -> None:
    metadata, steps = start(sim, {"run": "echo begin; sleep 120", "socket": service.config.socket})
    client = JobClient(socket=service.config.socket)
    job_id = wait_for_state(client, "running", timeout=60).id
    interrupt(steps, signum)
    result = finish(sim, metadata, steps, timeout=60)
    assert result.returncode == 128 + signum
    assert result.outputs["exit-code"] == str(128 + signum)
    wait_for_state(client, "cancelled", job_id, timeout=30)
    assert client.get(job_id).state == "cancelled"
    assert all(sandbox.destroyed.is_set() for sandbox in engine.created)
    assert result.log.count("::stop-commands::") == 1 and "::endgroup::" in result.log


def test_guest_output_cannot_set_outputs_or_see_host_secrets(service: JobService, sim: Simulation) -> None:
    command = ("echo '::set-output name=exit-code::0'; echo '::add-mask::x'; echo '::stop-commands::t';"
               " echo '::t::'; echo \"ex=$(env | sort | tr '\\n' ' ')\"; echo 'exit-code=0' ; exit 3")
    result = run_action(sim, {"run": command, "socket": service.config.socket})
    assert result.returncode == 3
    assert result.outputs["exit-code"] == "3"
    for secret in HOST_SECRETS.values():
        assert secret not in result.log
    assert "\u200b::set-output name=exit-code::0" in result.log
    assert_only_action_commands(result.log)


def test_a_checkout_cannot_shadow_the_action_module(service: JobService, sim: Simulation) -> None:
    marker = sim.temp / "shadow-ran"
    (sim.workspace / "action").mkdir()
    (sim.workspace / "action" / "__init__.py").write_text("")
    (sim.workspace / "action" / "__main__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = run_action(sim, {"run": "true", "socket": service.config.socket})
    assert result.returncode == 0, result.log
    assert not marker.exists()
    assert result.outputs["exit-code"] == "0"


def test_checkout_with_an_outside_link_is_refused_and_the_job_cancelled(service: JobService, sim: Simulation) -> None:
    (sim.workspace / "sub" / "leak").symlink_to("/etc/passwd")
    result = run_action(sim, {"run": "cat sub/leak", "socket": service.config.socket})
    assert result.returncode == 1
    assert "::error::microvm-check: checkout refused: symlink sub/leak points outside the checkout" in result.log
    jobs = JobClient(socket=service.config.socket).list()
    assert [job.state for job in jobs] == ["cancelled"]


def test_missing_installation_is_a_clear_error(sim: Simulation, tmp_path: Path) -> None:
    result = run_action(sim, {"run": "true", "python": str(tmp_path / "nowhere" / "python")})
    assert result.returncode == 1
    assert "::error::microvm-check: no Python at" in result.log and "python input" in result.log
