"""`keep: job` on real VMs, driven through action.yml as the runner runs it: three steps of one job
(install, lint, test) in one VM, each with its own exit code and log; files and a background process
outlive their step; no VM is left once the job's last step ends, or once its runner dies.
Needs root, QEMU and the built `base` template: skipped locally, failing under CI=true.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from action_harness import FORK_PR, Simulation, run_action
from test_action_vm_e2e import template  # noqa: F401  (the fixture: root, QEMU, the base template)

from tests.reference import captured

pytestmark = pytest.mark.vm

RUNNER = "mvc-keep-runner"
INSTALL = ("mkdir -p build && echo installed > build/marker && "
           "(sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 </dev/null & echo $! > /tmp/daemon.pid)")
LINT = 'kill -0 "$(cat /tmp/daemon.pid)" && echo daemon-alive && exit 3'
TEST = 'test "$PWD" = /workspace && cat build/marker && cat README'


@pytest.fixture
def host(template: None) -> Iterator[object]:
    """The real job service on this test's own engine (pool of one) and socket."""
    from runner.service.config.reading import config_from_mapping
    from runner.service.host.assembly import EngineSettings, ServiceHost
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    short = Path(tempfile.mkdtemp(prefix="mvc-keep-", dir="/tmp"))
    config = config_from_mapping({"socket": str(short / "api.sock"), "state_dir": str(short / "state"),
                                  "shutdown_grace_seconds": 30})
    try:
        with ServiceHost(config, engine=EngineSettings(templates=TemplateStore(StateDir.default().templates),
                                                       pool_size=0)) as running:
            yield running
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def sim(tmp_path: Path) -> Simulation:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "README").write_text("from the checkout\n")
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    return Simulation(workspace, temp, captured(FORK_PR),
                      extra_env={"RUNNER_NAME": RUNNER})


def _step(host, sim: Simulation, run: str, keep: str):
    result = run_action(sim, {"run": run, "keep": keep, "socket": host.config.socket})
    job_id = json.loads(result.outputs["result-json"])["record"]["id"]
    return result, host.service.get(job_id)


def test_three_steps_share_one_vm_and_none_is_left(host, sim: Simulation) -> None:
    install, first = _step(host, sim, INSTALL, "job")
    assert install.returncode == 0, install.log
    assert "packing" in install.log
    assert [vm.id for vm in host.engine.live()] == [first.vm_id]  # kept after its step

    lint, second = _step(host, sim, LINT, "job")
    assert lint.returncode == 3 and lint.outputs["exit-code"] == "3", lint.log
    assert "daemon-alive" in lint.log  # a process step 1 started still runs in step 2
    assert "packing" not in lint.log and "earlier step of this job kept" in lint.log

    test, third = _step(host, sim, TEST, "none")
    assert test.returncode == 0, test.log
    assert "installed" in test.log and "from the checkout" in test.log  # step 1's files, the one checkout
    assert first.vm_id == second.vm_id == third.vm_id
    assert len({first.id, second.id, third.id}) == 3
    assert [(r.state, r.exit_code) for r in (first, second, third)] == [("finished", 0), ("finished", 3),
                                                                       ("finished", 0)]
    assert all(log.count("::group::") == 1 for log in (install.log, lint.log, test.log))
    assert host.engine.live() == [] and host.service.sessions.count() == 0


def test_a_dead_runner_takes_the_kept_vm_with_it(host, sim: Simulation) -> None:
    install, first = _step(host, sim, INSTALL, "job")
    assert install.returncode == 0, install.log
    assert [vm.id for vm in host.engine.live()] == [first.vm_id]
    host.desk.runner_died(RUNNER, "the runner's process ended in the middle of its job")
    assert host.engine.live() == [] and host.service.sessions.count() == 0


def test_a_later_job_with_the_same_ids_but_without_the_token_gets_a_vm_of_its_own(host, sim: Simulation,
                                                                                    tmp_path: Path) -> None:
    """nektos/act gives every run GITHUB_RUN_ID=1: the ids a step sends are no credential. A second
    job naming the first job's repository, run, attempt, job and runner, but with a RUNNER_TEMP of its
    own (so without the session token the first step was answered), neither sees nor ends the kept VM."""
    install, first = _step(host, sim, INSTALL, "job")
    assert install.returncode == 0, install.log
    other_temp = tmp_path / "other-runner-temp"
    other_temp.mkdir()
    impostor = Simulation(sim.workspace, other_temp, sim.event_payload, extra_env=dict(sim.extra_env))
    peek, peeked = _step(host, impostor, "cat build/marker && echo PEEK$((1 + 1))", "none")
    assert peek.returncode != 0 and "PEEK2" not in peek.log and "No such file" in peek.log, peek.log
    assert peeked.vm_id != first.vm_id
    assert [vm.id for vm in host.engine.live()] == [first.vm_id]  # the kept VM is still the first job's
    token_file = sim.temp / "microvm-check-session"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert token_file.read_text().strip() not in json.dumps(sim.env())  # never in a step's environment
    test, last = _step(host, sim, TEST, "none")
    assert test.returncode == 0 and "installed" in test.log, test.log
    assert last.vm_id == first.vm_id and not token_file.exists()
    assert host.engine.live() == [] and host.service.sessions.count() == 0
