"""A job ends when its job ends: the service enforces it, not signals the job controls.

Stand-in runners and the real service, real VMs where a VM is involved:
- a job whose host-side step submits in the background with the repository in another letter case,
  kills its own job-completed hook and exits 0 has its VM job cancelled within seconds of its
  runner's exit (the runner's end, whatever its exit code, ends what its job runs);
- GitHub's `completed` for a runner's job, in any letter case, revokes that runner's token: it
  submits nothing after;
- a busy runner that SIGSTOPs itself is killed at its deadline and what its job ran fails with a reason.
"""

from __future__ import annotations

import json
import shlex
import time

import pytest

from runner.jobapi.client import JobAPIError, JobClient
from tests.fleet.conftest import LABELS
from tests.fleet.test_fleet import wait_until
from tests.fleet.test_fleet_access import RUN_ID, spec, started

# The step: the action in the background (as a detached process of the job would be), submitting with the
# repository in upper case; a loop that kills the job-completed hook as soon as it starts; the step
# itself waits for the test's go (the VM job runs), then exits 0.
DODGE = r'''
export INPUT_RUN='echo in-the-vm; sleep 600' INPUT_SOCKET={socket} INPUT_TIMEOUT_MINUTES=10
GITHUB_REPOSITORY=LISTENDEV/LSTN setsid "$MICROVM_CHECK_PYTHON" -I -m action >"$RUNNER_TEMP/bg.log" 2>&1 </dev/null &
setsid sh -c 'while :; do pkill -KILL -f job-complete[d]; sleep 0.02; done' >/dev/null 2>&1 </dev/null &
while [ ! -e {go} ]; do sleep 0.1; done
echo step-done
'''


def test_a_job_that_kills_its_completed_hook_and_exits_0_is_cancelled_with_its_runner(make_rig) -> None:
    with make_rig(min_idle=0, max_runners=1) as rig:
        go = rig.root / "go"
        script = DODGE.format(socket=shlex.quote(str(rig.root / "api.sock")), go=shlex.quote(str(go)))
        rig.enqueue(1, [{"run": script}])
        job = wait_until(lambda: next((r for r in rig.host.service.list(limit=5) if r.state.value == "running"),
                                      None), 600, "the background submit's VM job to run")
        vm_id = rig.host.service.get(job.id).vm_id
        runner = rig.fleet.runners()[0]
        go.touch()
        result = wait_until(lambda: rig.github.results(), 120, "the runner to finish")[0]["result"]
        final = wait_until(lambda: (r := rig.host.service.get(job.id)).final and r, 60, "the VM job to end")
        ended_at = final.timings.finished_at
        wait_until(lambda: vm_id not in {vm.id for vm in rig.host.engine.live()}, 60, "the VM to go")
        with JobClient(socket=str(rig.root / "api.sock"), runner_token=runner.token) as client:
            with pytest.raises(JobAPIError) as revoked:
                client.submit(spec())
    assert result["steps"] == [0] and "step-done" in result["log"], result["log"]
    assert "cancelled what this job still ran" not in result["log"]  # the hook never got to say it
    assert job.repository == "listendev/lstn"  # the name GitHub gave the runner, not the submit's spelling
    assert final.state.value == "cancelled", final
    assert f"the runner {runner.name} running this job ended (exit code 0)" in final.error
    assert ended_at - result["ended_at"] < 30, "the VM job outlived its runner"
    assert revoked.value.status == 401


def test_completed_in_another_letter_case_revokes_the_runners_token(make_rig) -> None:
    with make_rig(vms=False, min_idle=1, max_runners=1, shutdown_grace_seconds=0) as rig:
        runner = wait_until(lambda: rig.fleet.runners(), 60, "a runner")[0]
        socket = str(rig.root / "api.sock")
        with JobClient(socket=socket, runner_token=runner.token) as client:
            assert client.job_started(started()).allowed
            before = client.submit(spec())
            job = {"job_id": 1, "run_id": RUN_ID, "run_attempt": 1, "repository": "ListenDev/LSTN", "job": "check"}
            rig.github.deliver_failed(job, LABELS, runner.name)
            with pytest.raises(JobAPIError) as after:
                client.submit(spec())
            final = rig.host.service.get(before.id)
    assert final.state.value == "cancelled" and "GitHub reports the job completed" in final.error
    assert after.value.status == 401 and "not one this service issued" in str(after.value)


def test_a_sigstopped_runner_is_killed_at_its_deadline(make_rig) -> None:
    stop = 'echo stopping; kill -STOP "$PPID"; sleep 600'  # the runner (the step's parent) freezes
    with make_rig(vms=False, min_idle=0, max_runners=1, job_timeout_seconds=3, deadline_grace_seconds=1) as rig:
        rig.enqueue(1, [{"run": stop}])
        runner = wait_until(lambda: [r for r in rig.fleet.runners() if r.job], 60, "the runner to take the job")[0]
        with JobClient(socket=str(rig.root / "api.sock"), runner_token=runner.token) as client:
            submitted = client.submit(spec(run_id=RUN_ID))
        wait_until(lambda: not rig.fleet.runners(), 60, "the runner to be killed")
        killed_after = time.time() - runner.since  # from when the fleet saw it busy, not the test
        end = next(e for e in rig.fleet.ended if e.name == runner.name)
        final = rig.host.service.get(submitted.id)
        pid_gone = not any(rig.fleet.runners())
    assert pid_gone and end.died, end
    assert 3 <= killed_after < 15, killed_after
    assert final.state.value == "cancelled"
    assert f"runner {runner.name} passed its deadline (job timeout 3 s + grace 1 s)" in final.error
    assert json.dumps(rig.github.results()) == "[]"  # the runner never wrote a result: it was killed
