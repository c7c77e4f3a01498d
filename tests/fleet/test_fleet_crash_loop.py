"""A fleet whose runners cannot start (runner/fleet/starts.py): the installed release's run.sh prints a line
and exits 3 at once, as a runner whose program or hooks the walls hide does. The fleet retries with a
back-off, says so in `status`, the log and the metrics with the exit status and the last output, leaves
no cgroup per try, and a test waiting on such a fleet gives up at once with that reason."""

from __future__ import annotations

import hashlib
import io
import logging
import secrets
import tarfile
from pathlib import Path

import pytest

from runner.fleet import cgroup, install
from runner.fleet.cgroup import CgroupError, RunnerCgroup, RunnerCgroupLimits
from runner.fleet.starts import CRASH_LOOP_TRIES, retry_delay
from tests.fleet.conftest import PYTHON, STANDIN, VERSION
from tests.fleet.waiting import wait_until

SAID = "the runner cannot start: no such thing"
CRASH_SH = f'#!/bin/sh\necho "{SAID}" >&2\nexit 3\n'


# Exits at once like CRASH_SH until the test lets runners start (a file in the rig), then is the stand-in.
RECOVERING_SH = (f'#!/bin/sh\n[ -e "$MAY_START" ] || {{ echo "{SAID}" >&2; exit 3; }}\n'
                 f'exec {PYTHON} -I "$(dirname "$0")/bin/standin_runner.py" "$@"\n')


def install_crashing_release(root: Path, run_sh: str = CRASH_SH) -> None:
    """The release the rig's runners start from (the rig installs the stand-in only when none is there)."""
    path = root / "crash.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, data, mode in (("./run.sh", run_sh.encode(), 0o755), ("./bin/standin_runner.py", STANDIN.read_bytes(),
                                                                       0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))
    install.install(path, VERSION, hashlib.sha256(path.read_bytes()).hexdigest(), root / "release")


def runner_cgroups(scope: str) -> set[str]:
    """The runner groups of `scope` in every hierarchy the fleet makes them in (v2, or v1's pids, memory, cpu)."""
    from runner.vm.cgroup import v1_mount

    unified = (cgroup.ROOT / "cgroup.controllers").exists()
    roots = [cgroup.ROOT] if unified else [m for c in ("pids", "memory", "cpu") if (m := v1_mount(c)) is not None]
    scopes = [root / cgroup.PARENT / scope for root in roots]
    return {entry.name for path in scopes if path.is_dir() for entry in path.iterdir() if entry.is_dir()}


def test_runners_that_exit_at_once_are_retried_with_back_off_and_reported(make_rig, rig_root, caplog, capsys) -> None:
    from runner.cli import main

    install_crashing_release(rig_root)
    caplog.set_level(logging.WARNING, logger="runner.fleet.fleet")
    with make_rig(vms=False, min_idle=1, max_runners=1) as rig:
        loop = wait_until(lambda: rig.fleet.crash_loop(), 120, "the fleet to report a crash loop")
        tries = list(rig.fleet.ended)
        groups = runner_cgroups(rig.fleet.processes.scope)
        assert main(["status", "--service-config", str(rig.config_path)]) == 0
        shown = capsys.readouterr().out
        metrics = rig.host.metrics.exposition().decode()
    assert loop["tries"] >= CRASH_LOOP_TRIES and loop["exit"] == "exit code 3" and SAID in loop["output"], loop
    assert f"CRASH LOOP: {loop['tries']} runners in a row ended before taking a job" in shown, shown
    assert "ended (exit code 3)" in shown and f"    {SAID}" in shown, shown
    for number, (ended, started) in enumerate(zip(tries, tries[1:]), start=1):
        assert started.since - ended.ended_at >= retry_delay(number), (number, ended, started)
    assert not groups & {end.name for end in tries}, f"tries left their cgroups: {groups}"
    assert "microvm_check_runner_crash_loop 1.0" in metrics
    assert f"microvm_check_runner_failed_starts_total {float(len(tries))}" in metrics
    said = [r.getMessage() for r in caplog.records if r.name == "runner.fleet.fleet"]
    assert any(message.startswith(f"runner {tries[0].name} ended (exit code 3)") and SAID in message
               for message in said), said
    assert any("runners cannot start (crash loop" in message for message in said), said


def test_a_wait_on_a_fleet_whose_runners_cannot_start_gives_up_at_once_with_the_reason(make_rig, rig_root) -> None:
    install_crashing_release(rig_root)
    with make_rig(vms=False, min_idle=0, max_runners=1) as rig:
        rig.enqueue(1, [{"run": "echo never"}])
        with pytest.raises(AssertionError, match=rf"gave up waiting for the job: the fleet reports a crash loop: "
                                                 rf"\d+ runners in a row .*exit code 3.*{SAID}"):
            wait_until(lambda: rig.github.results(), 300, "the job")


def test_a_runner_that_takes_a_job_ends_the_crash_loop(make_rig, rig_root) -> None:
    may_start = rig_root / "runners-may-start"
    install_crashing_release(rig_root, RECOVERING_SH.replace("$MAY_START", str(may_start)))
    with make_rig(vms=False, min_idle=1, max_runners=1) as rig:
        wait_until(lambda: rig.fleet.crash_loop(), 120, "the fleet to report a crash loop")
        may_start.touch()
        rig.enqueue(1, [{"run": "echo took-it"}])
        result = wait_until(lambda: rig.github.results(), 120, "the job", past_crash_loop=True)[0]["result"]
        after = rig.fleet.status()
    assert result["conclusion"] == "success", result["log"]
    assert after["crash_loop"] is None and rig.fleet.failed_starts.in_a_row == 0


def test_a_runner_cgroup_whose_limits_the_kernel_refuses_leaves_no_directory(need_root) -> None:
    scope = f"test{secrets.token_hex(4)}"
    try:
        with pytest.raises(CgroupError, match="cannot create the runner's cgroup for mvc-refused"):
            RunnerCgroup.create(scope, "mvc-refused", RunnerCgroupLimits(memory_bytes=-5, cpu_weight=100))
        assert runner_cgroups(scope) == set()
    finally:
        for root in (cgroup.ROOT, *cgroup.ROOT.iterdir()):  # only when the test fails: leave nothing on the host
            if (root / cgroup.PARENT / scope / "mvc-refused").is_dir():
                (root / cgroup.PARENT / scope / "mvc-refused").rmdir()
        cgroup.remove_scope(scope)
