"""Every gauge the service exports, compared with what it claims to count: QEMU processes on the host, job
records, the queue, the spare pool (real VMs; `status` is checked against the same processes)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runner.jobapi.client import JobClient
from runner.jobapi.contract import ACTIVE_STATES
from tests.e2e.vm_jobs import submit, templates, vm_host, vm_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vm

TOKEN = "a-test-token-of-32-characters-xx"


def qemu_processes(vms: Path) -> int:
    """QEMU processes whose command line names a VM directory of this engine."""
    marker = (str(vms) + "/").encode()
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and cmdline.split(b"\0", 1)[0].endswith(b"qemu-system-x86_64"):
            count += 1
    return count


def gauges(base: str) -> dict[tuple[str, tuple], float]:
    answer = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(answer.text)
            if family.type == "gauge" for s in family.samples}


def wait_for(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def assert_gauges_tell_the_truth(host, base: str) -> dict[tuple[str, tuple], float]:
    engine, service = host.engine, host.service
    seen = gauges(base)
    qemus = qemu_processes(engine.state.vms)
    assert seen[("microvm_check_vms_running", ())] == qemus == (len(engine.live()) + sum(engine.pool.ready().values())
                                                                + engine.standby_vmms())
    assert seen[("microvm_check_spare_vms", ())] == sum(engine.pool.ready().values())
    assert seen[("microvm_check_spare_pool_size", ())] == 1
    records = list(service.records.in_states(ACTIVE_STATES))
    for state in ACTIVE_STATES:
        assert seen[("microvm_check_jobs_active", (("state", state.value),))] == \
            sum(r.state == state for r in records), state
    assert seen[("microvm_check_queue_depth", ())] == service.queue.counts()[0]
    assert seen[("microvm_check_prewarmed_vms", ())] == service.prewarmed.count()
    assert seen[("microvm_check_prewarmed_vms_max", ())] == host.config.prewarm.max_vms
    assert seen[("microvm_check_build_info", next(k for n, k in seen if n == "microvm_check_build_info"))] == 1
    assert host.fleet is None and seen[("microvm_check_runner_crash_loop", ())] == 0  # no fleet: no runner started
    known = {"microvm_check_vms_running", "microvm_check_spare_vms", "microvm_check_spare_pool_size",
             "microvm_check_jobs_active", "microvm_check_queue_depth", "microvm_check_prewarmed_vms",
             "microvm_check_prewarmed_vms_max", "microvm_check_build_info", "microvm_check_runner_crash_loop"}
    assert {name for name, _ in seen} == known, "a gauge this test does not compare with what it counts"
    return seen


def test_gauges_match_processes_and_records(vm_host) -> None:
    host = vm_host(listen="127.0.0.1:0", token=TOKEN)
    address = host.api.tcp_address
    base = f"http://{address[0]}:{address[1]}"
    client = JobClient(socket=host.config.socket)
    job = submit(client, "echo started; sleep 120")
    for entry in client.logs(job):
        if entry.data == b"started\n":
            break
    wait_for(lambda: sum(host.engine.pool.ready().values()) == 1, 180, "the spare VM")
    wait_for(lambda: host.engine.standby_vmms() == 1, 180, "the VMM spawned ahead")
    during = assert_gauges_tell_the_truth(host, base)
    assert during[("microvm_check_vms_running", ())] == 3  # the job's VM, the spare, the VMM spawned ahead
    status = client.status()
    assert [vm["job"] for vm in status["vms"]] == [job]
    assert sum(status["spare_pools"]["ready"].values()) == 1 and status["spare_pools"]["size"] == 1
    assert status["recent_jobs"][0]["id"] == job and status["queue"]["running"] == 1
    client.cancel(job)
    wait_for(lambda: client.get(job).final and not host.engine.live(), 60, "the cancelled job's VM to go")
    after = assert_gauges_tell_the_truth(host, base)
    assert after[("microvm_check_vms_running", ())] == 2  # the spare and the VMM spawned ahead live on
