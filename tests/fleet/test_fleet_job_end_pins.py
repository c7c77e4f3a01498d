"""Two decisions of a job's end that tests/fleet/test_fleet_job_end.py leaves free:

- a busy runner's deadline is its job's timeout *plus* the grace (runner/fleet/fleet.py,
  `deadline_seconds`): with a 1 s timeout and a 4 s grace a frozen runner still lives at 2 s;
- GitHub's `completed` revokes the tokens of the jobs the runner's job submitted, not only the
  runner's own (runner/service/jobs/auth.py, `Access.end_runner_job`): a job token kept by a detached
  process of the job reads nothing of its job afterwards.
"""

from __future__ import annotations

import time

from runner.jobapi.client import JobClient
from tests.fleet.conftest import LABELS
from tests.fleet.test_fleet import wait_until
from tests.fleet.test_fleet_access import RUN_ID, probe, spec, started


def test_a_frozen_runner_lives_through_its_jobs_timeout_and_dies_at_timeout_plus_grace(make_rig) -> None:
    stop = 'echo stopping; kill -STOP "$PPID"; sleep 600'  # the runner (the step's parent) freezes
    with make_rig(vms=False, min_idle=0, max_runners=1, job_timeout_seconds=1, deadline_grace_seconds=4) as rig:
        rig.enqueue(1, [{"run": stop}])
        runner = wait_until(lambda: [r for r in rig.fleet.runners() if r.job], 60, "the runner to take the job")[0]
        wait_until(lambda: not rig.fleet.runners(), 60, "the runner to be killed")
        killed_after = time.time() - runner.since  # from when the fleet saw it busy, not the test
        end = next(e for e in rig.fleet.ended if e.name == runner.name)
    assert end.died
    assert killed_after >= 3.0, f"killed {killed_after:.1f} s after taking its job: before timeout 1 s + grace 4 s"


def test_completed_revokes_the_tokens_of_the_jobs_the_runners_job_submitted(make_rig) -> None:
    with make_rig(vms=False, min_idle=1, max_runners=1, shutdown_grace_seconds=0) as rig:
        runner = wait_until(lambda: rig.fleet.runners(), 60, "a runner")[0]
        socket = rig.root / "api.sock"
        with JobClient(socket=str(socket), runner_token=runner.token) as client:
            assert client.job_started(started()).allowed
            submitted = client.submit(spec())
        # a detached process of the job (the runner user, no runner token) that kept the job's token
        before = probe(rig.account, socket, [["get", submitted.id, submitted.token]])
        job = {"job_id": 1, "run_id": RUN_ID, "run_attempt": 1, "repository": "listendev/lstn", "job": "check"}
        rig.github.deliver_failed(job, LABELS, runner.name)
        after = probe(rig.account, socket, [["get", submitted.id, submitted.token]])
    assert before[0]["status"] == 200, before
    assert after[0]["status"] == 403 and "can only be reached with the job token" in after[0]["error"], after
