"""The action end to end on real VMs: action.yml as the runner runs it, the real job service with its
default (QEMU) sandbox factory, a passing and a failing suite, a timeout, a cancel, and a hostile
checkout. Needs root, QEMU and the built `base` template: skipped locally, failing under CI=true.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from action.logs import RelayLimits
from runner.jobapi.workflow import ZWSP
from tests.action.action_harness import (
    FORK_PR,
    HOST_SECRETS,
    Simulation,
    assert_only_action_commands,
    finish,
    interrupt,
    run_action,
    start,
    wait_for_state,
)
from tests.conftest import require
from tests.e2e.fake_internet import ALLOWED_HOST, DENIED_HOST, METADATA, FakeInternet, cidr_policy, fake_internet
from tests.reference import captured

if TYPE_CHECKING:
    from runner.service.host.assembly import ServiceHost

pytestmark = pytest.mark.vm

TESTS = '''
import os

def test_one():
    assert True

def test_two():
    assert os.path.exists("pass-me"), "pass-me is missing"
'''
# No pytest in the guest image is assumed: a tiny runner writes the same JUnit shape pytest does.
RUN_TESTS = r'''
import os, sys, traceback
sys.path.insert(0, "tests")
import test_sample
cases, failed = [], 0
for name in ("test_one", "test_two"):
    try:
        getattr(test_sample, name)()
        cases.append(f'<testcase classname="tests.test_sample" name="{name}"/>')
    except AssertionError as exc:
        failed += 1
        line = traceback.extract_tb(exc.__traceback__)[-1].lineno
        cases.append(f'<testcase classname="tests.test_sample" name="{name}"><failure message="{exc}">'
                     f'tests/test_sample.py:{line}: AssertionError</failure></testcase>')
os.makedirs("out", exist_ok=True)
with open("out/report.xml", "w") as f:
    f.write(f'<testsuites><testsuite name="t" tests="2">{"".join(cases)}</testsuite></testsuites>')
print(f"{2 - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
'''


@pytest.fixture(scope="module")
def template() -> None:
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    require(os.path.exists("/dev/net/tun"), "/dev/net/tun is missing")
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateNotFound, TemplateStore

    try:
        TemplateStore(StateDir.default().templates).get("base")
    except TemplateNotFound as exc:
        require(False, str(exc))


def _host(settings: dict[str, object], internet: FakeInternet | None = None) -> Iterator[ServiceHost]:
    """The real job service (ServiceHost) on this test's own engine and socket; networked on `internet`."""
    from runner.service.config.reading import config_from_mapping
    from runner.service.host.assembly import EngineSettings, ServiceHost
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    short = Path(tempfile.mkdtemp(prefix="mvc-act-vm-", dir="/tmp"))
    config = config_from_mapping({"socket": str(short / "api.sock"), "state_dir": str(short / "state"),
                                  "shutdown_grace_seconds": 30, **settings})
    # Real VMs, from an engine of this test's own: a service running on the host keeps its state dir.
    templates = TemplateStore(StateDir.default().templates)
    engine = internet.engine(templates=templates, pool_size=0) if internet else EngineSettings(templates=templates,
                                                                                                pool_size=1)
    try:
        with ServiceHost(config, engine=engine) as host:
            assert host.service is not None and host.engine is not None
            yield host
            host.service.drain()
            assert host.engine.live() == [], "a job's VM outlived the service"
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def host(template: None) -> Iterator[ServiceHost]:
    yield from _host({})


@pytest.fixture
def service(host: ServiceHost) -> object:
    return host.service


# The repository of the simulated pull request (FORK_PR's base) may reach ALLOWED_HOST:8000, nothing else.
HOSTILE_POLICY = cidr_policy(f"{ALLOWED_HOST}:8000")


@pytest.fixture
def net_service(template: None, need_netns: None, tmp_path: Path) -> Iterator[object]:
    """A networked service whose VMs hang off a fake internet the test built, with a policy store that
    lets the simulated pull request's repository reach one fake host. Its log budget (64 MiB) is above
    the relay's (16 MiB): the flood below is cut by the relay, and the job still ends with its own code."""
    store = tmp_path / "policies" / "listendev"
    store.mkdir(parents=True)
    (store / "lstn.yml").write_text(HOSTILE_POLICY)
    with fake_internet() as internet:
        for host in _host({"network": internet.network, "policy_dir": str(store.parent),
                           "logs": {"max_bytes": "64MiB"}}, internet):
            yield host.service


@pytest.fixture
def sim(tmp_path: Path) -> Simulation:
    workspace = tmp_path / "workspace"
    (workspace / "tests").mkdir(parents=True)
    (workspace / "tests" / "test_sample.py").write_text(TESTS)
    (workspace / "run_tests.py").write_text(RUN_TESTS)
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    return Simulation(workspace, temp, captured(FORK_PR))


def suite_inputs(service) -> dict[str, str]:
    return {"run": "python3 run_tests.py", "artifacts": "out/report.xml", "socket": service.config.socket}


def test_passing_suite_in_a_vm(host: ServiceHost, service, sim: Simulation) -> None:
    """...and its log comes back on the upload's own request: the service answered one checkout request,
    with the log stream (200, not 202), and no request for the logs of their own."""
    (sim.workspace / "pass-me").write_text("")
    result = run_action(sim, suite_inputs(service))
    assert result.returncode == 0, result.log
    assert (result.outputs["exit-code"], result.outputs["junit-passed"], result.outputs["junit-failed"]) == ("0", "2", "0")
    record = json.loads(result.outputs["result-json"])["record"]
    assert record["state"] == "finished" and record["vm_id"]
    assert "VM ready" in result.summary
    assert "2 passed, 0 failed" in result.log  # the guest's output, relayed
    assert _answered(host) == {("POST", "/v1/jobs", "201"): 1, ("PUT", "/v1/jobs/{id}/checkout", "200"): 1,
                               ("GET", "/v1/jobs/{id}/artifacts", "200"): 1,
                               ("GET", "/v1/jobs/{id}/attestation", "200"): 1}


def _answered(host: ServiceHost) -> dict[tuple[str, str, str], int]:
    """The requests the service's own metrics counted (`..._api_request_duration_seconds`), by method, route
    and status; each is counted once it has ended (a log stream: with its job)."""
    assert host.metrics is not None
    counted: dict[tuple[str, str, str], int] = {}
    for family in host.metrics.registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_api_request_duration_seconds_count") and sample.value:
                labels = sample.labels
                counted[(labels["method"], labels["route"], labels["status"])] = int(sample.value)
    return counted


def test_failing_suite_in_a_vm(service, sim: Simulation) -> None:
    result = run_action(sim, suite_inputs(service))
    assert result.returncode == 1
    assert (result.outputs["exit-code"], result.outputs["junit-failed"]) == ("1", "1")
    assert any(line.startswith("::error file=tests/test_sample.py,line=8,title=tests.test_sample.test_two::")
               for line in result.log.splitlines()), result.log


def test_timeout_in_a_vm(service, sim: Simulation) -> None:
    result = run_action(sim, {"run": "sleep 600", "timeout-minutes": "0.1", "socket": service.config.socket})
    assert result.returncode == 124 and result.outputs["exit-code"] == "124"


def test_cancel_in_a_vm(service, sim: Simulation) -> None:
    from runner.jobapi.client import JobClient

    metadata, steps = start(sim, {"run": "echo started; sleep 600", "socket": service.config.socket})
    client = JobClient(socket=service.config.socket)
    job_id = wait_for_state(client, "running", timeout=300, interval=0.25).id
    interrupt(steps)
    result = finish(sim, metadata, steps, timeout=120)
    assert result.returncode == 130
    wait_for_state(client, "cancelled", job_id, timeout=60)
    assert client.get(job_id).state == "cancelled"


def test_hostile_checkout_changes_nothing_and_still_reports(net_service, sim: Simulation, tmp_path: Path) -> None:
    """A fork's checkout that tries everything, on a networked service: its VM has a NIC (it reaches the
    one host its repository's policy allows), and nothing else it dials answers; its flood is cut by the
    relay; its exit code still comes through."""
    service = net_service
    host_marker = secrets.token_hex(16)
    host_file = Path(tempfile.mkdtemp(prefix="mvc-act-host-")) / "host-only.txt"
    host_file.write_text(host_marker)
    hostile = f'''
echo "::set-output name=exit-code::0"
echo "::add-mask::passed"
echo "::add-path::/tmp/evil-path"
echo "::set-env name=EVIL::1"
echo "::stop-commands::guess"
echo "::guess::"
echo "::echo::on"
printf '::set-output name=junit-failed::0\\r::add-mask::cr\\n'
echo "GITHUB_OUTPUT=$GITHUB_OUTPUT GITHUB_ENV=$GITHUB_ENV"
env
cat {host_file} 2>&1
ls {sim.workspace} 2>&1
python3 - <<'PY'
import socket
gw = None
for line in open("/proc/net/route").read().splitlines()[1:]:
    f = line.split()
    if f[1] == "00000000":
        gw = socket.inet_ntoa(bytes.fromhex(f[2])[::-1])
print("default gateway", gw)
forbidden = [(gw, 22), (gw, 80), (gw, 443), ("{DENIED_HOST}", 8000), ("{METADATA}", 80)]
for host, port in [*forbidden, ("{ALLOWED_HOST}", 8000)]:
    try:
        socket.create_connection((host, port), timeout=3).close()
        print("ALLOWED-REACHED" if (host, port) not in forbidden else "NET-REACHED", host, port)
    except Exception as exc:
        print("net blocked", host, port, type(exc).__name__)
PY
mkdir -p out
ln -s /etc/passwd out/evil.xml
head -c 20000000 /dev/zero | tr '\\0' 'x' | fold -w 1000
exit 7
'''
    (sim.workspace / "hostile.sh").write_text(hostile)
    result = run_action(sim, {"run": "sh hostile.sh", "artifacts": "out/*", "socket": service.config.socket})
    try:
        assert result.returncode == 7
        assert result.outputs["exit-code"] == "7" and result.outputs["junit-failed"] == ""
        assert f"{ZWSP}::set-output name=exit-code::0" in result.log
        assert [line for line in result.log.splitlines() if line.startswith("::stop-commands::")] == [
            line for line in result.log.splitlines()[:3] if line.startswith("::stop-commands::")]
        for secret in [*HOST_SECRETS.values(), host_marker]:
            assert secret not in result.log
        # The guest has a network card and a route (it reached the allowed host), yet nothing else answered.
        assert "default gateway 192.0.2.1" in result.log
        assert f"ALLOWED-REACHED {ALLOWED_HOST} 8000" in result.log
        assert "NET-REACHED" not in result.log and result.log.count("net blocked") == 5
        # The guest printed 20 MB, more than the relay shows (RelayLimits().max_bytes, 16 MiB) and less than
        # this service keeps (64 MiB), so the job ends with the command's own code (a job whose log passes
        # the service's budget ends as failed: tests/e2e/test_vm_e2e.py::test_log_flood_is_truncated).
        # Plus the action's own lines: 1 MiB is far more than those take.
        assert 20_000_000 > RelayLimits().max_bytes
        assert "log truncated" in result.log and len(result.log) < RelayLimits().max_bytes + 1024**2
        # The symlink is named in a warning (an annotation the runner models accept below) and never
        # written: not into the checkout, not into the artifacts directory.
        assert "::warning::artifact out/evil.xml not copied: links are not allowed" in result.log
        assert not os.path.lexists(sim.workspace / "out" / "evil.xml")
        assert not os.path.lexists(sim.workspace / "artifacts" / "out" / "evil.xml")
        assert not os.path.exists("/tmp/evil-path")
        # What the runner would do with this log: none of the guest's commands (outputs, masks, paths,
        # env, its own stop/resume token, echo) executes; only the relay's frame and the action's annotations.
        assert_only_action_commands(result.log)
        record = json.loads(result.outputs["result-json"])["record"]
        assert (record["state"], record["exit_code"], record["error"]) == ("finished", 7, None)
        assert "exit code 7" in result.summary
        blocked = {(b["dest"], b["port"]) for b in record["blocked_egress"]}
        assert {(DENIED_HOST, 8000), (METADATA, 80)} <= blocked and (ALLOWED_HOST, 8000) not in blocked
    finally:
        shutil.rmtree(host_file.parent, ignore_errors=True)
