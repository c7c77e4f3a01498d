"""What a runner's job left on the host goes when that runner ends, while the fleet keeps running.

The fleet's own shutdown kills everything anyway, so this looks while the service still serves: the
runner that took the job is removed, and within seconds its job's `setsid` child is gone and so is
the runner's cgroup directory (runner/fleet/fleet.py, RunnerFleet._forget).
"""

from __future__ import annotations

import time

from tests.fleet.survivor import Survivor
from tests.fleet.test_fleet import wait_until

WITHIN_SECONDS = 5.0


def test_a_runner_removed_while_the_fleet_runs_leaves_no_process_and_no_cgroup(make_rig) -> None:
    with make_rig(vms=False, min_idle=0, max_runners=1) as rig, Survivor() as survivor:
        rig.enqueue(1, [{"run": survivor.step}])
        runner = wait_until(lambda: rig.fleet.runners(), 60, "a runner for the job")[0]
        group = runner.cgroup.path
        assert group.is_dir()
        try:
            result = wait_until(lambda: rig.github.results(), 120, "the job to end")[0]["result"]
            assert result["conclusion"] == "success", result["log"]
            assert survivor.seen, "the job's setsid child was never seen running on the host"
            wait_until(lambda: not rig.fleet.runners(), 60, "the runner to be removed")
            assert survivor.gone_within(WITHIN_SECONDS), \
                f"the job's setsid child (host pid {survivor.alive()}) outlived its runner by {WITHIN_SECONDS:g} s"
            removed = time.monotonic()
            while time.monotonic() - removed < WITHIN_SECONDS and group.exists():
                time.sleep(0.1)
            assert not rig.fleet.stopping  # still serving: nothing of the shutdown did this
            assert not group.exists(), f"the ended runner's cgroup {group} is still there"
        finally:
            if group.exists():  # only on failure: leave no cgroup behind (before the fleet removes its scope)
                group.rmdir()
