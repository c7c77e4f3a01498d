"""Two jobs on two stand-in runners, the real service and real VMs: the second job's process cannot
reach the first job, nor submit as another repository; when the first job ends with its action gone
(killed, as a crashed step would leave it), its job-completed hook has the service cancel the job
and destroy the VM it still held."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.fleet.test_fleet import wait_until
from tests.fleet.test_fleet_access import PROBE, spec


def _action_pid(runner) -> int | None:
    """The action's process (`python -I -m action`) among the runner's cgroup's processes."""
    for pid in runner.cgroup.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and b"action" in argv:
            return pid
    return None


def test_a_second_job_cannot_reach_the_first_and_job_completed_destroys_its_vm(make_rig) -> None:
    with make_rig(min_idle=2, max_runners=2) as rig:
        rig.enqueue(1, [rig.action_step("echo first-job; sleep 600")])
        first = wait_until(lambda: next((r for r in rig.host.service.list(limit=5) if r.state.value == "running"),
                                        None), 600, "the first job to run in its VM")
        holder = wait_until(lambda: [r for r in rig.fleet.runners() if r.job and r.job.job.run_id == 700001], 30,
                            "the fleet to see the first runner busy")[0]
        assert first.repository == "listendev/lstn" and first.run_id == 700001
        requests = [["list"], ["get", first.id, None], ["logs", first.id, None], ["artifacts", first.id, None],
                    ["upload", first.id, None], ["cancel", first.id, None],
                    ["submit", spec("octo-org/other", 700002)]]
        socket = rig.root / "api.sock"
        rig.enqueue(2, [{"run": f"\"$MICROVM_CHECK_PYTHON\" -I probe.py '{json.dumps(requests)}' {socket}"}],
                    files={"probe.py": PROBE.read_text()})
        second = wait_until(lambda: [j for j in rig.github.results() if j["run_id"] == 700002], 300,
                            "the second job")[0]["result"]
        assert rig.host.service.get(first.id).state.value == "running", "the second job reached the first"
        vm_id = rig.host.service.get(first.id).vm_id
        assert vm_id in {vm.id for vm in rig.host.engine.live()}
        # The first job's action dies without cancelling (SIGKILL); the job ends, its completed hook runs.
        os.kill(wait_until(lambda: _action_pid(holder), 30, "the first job's action"), signal.SIGKILL)
        final = wait_until(lambda: (r := rig.host.service.get(first.id)).final and r, 120, "the first job to end")
        wait_until(lambda: vm_id not in {vm.id for vm in rig.host.engine.live()}, 60, "the first job's VM to go")
        ended = wait_until(lambda: [j for j in rig.github.results() if j["run_id"] == 700001], 60,
                           "the first runner to finish")[0]["result"]
    answers = [json.loads(line.split(" ", 1)[1]) for line in second["log"].splitlines() if line.startswith("probe ")]
    assert [a["op"] for a in answers] == [r[0] for r in requests], second["log"]
    assert all(a["status"] == 403 for a in answers), answers
    assert "listing all jobs is for the operator" in answers[0]["error"]
    assert f"job {first.id} can only be reached with the job token its submit answered" in answers[1]["error"]
    assert ("runs listendev/lstn run 700002/1 job check, but this submit is for octo-org/other run 700002/1 "
            "job check: a job may only be submitted by the runner GitHub gave it to") in answers[-1]["error"]
    assert ended["steps"] == [-signal.SIGKILL] or ended["steps"][0] != 0, ended
    assert final.state.value == "cancelled"
    assert f"runner {holder.name}'s job-completed hook" in final.error
    assert f"cancelled what this job still ran: {first.id}" in ended["log"]
