"""Without a fleet: the runner `register` sets up gets a credential of the service, and its jobs are
bound to the job its hook reports, as a fleet runner's are (on a service without a webhook, of the
repository its credential is held to: tests/fleet/test_fleet_registered_binding.py); a socket member
without a credential runs local jobs only, under the repository name the operator configured.

The real service (no VM needed: nothing is uploaded), the stand-in runner started as `run.sh` in a
directory `microvm-check runner credential` prepared, as the runner user.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import yaml

from tests.fleet.conftest import PYTHON, ROOT, Account, standin_tarball
from tests.fleet.fleet_fakes import FORK_PR
from tests.fleet.test_fleet import wait_until
from tests.fleet.test_fleet_access import PROBE, RUN_ID, probe, spec

NAME = "mvc-registered-1"


def _config(root: Path, account: Account, **more: Any) -> Path:
    path = root / "service.yml"
    path.write_text(yaml.safe_dump({"socket": str(root / "api.sock"), "socket_group": account.group,
                                    "state_dir": str(root / "state"), **more}))
    return path


def _runner_dir(root: Path, account: Account) -> Path:
    """The actions/runner release unpacked in a directory of the runner user's, as `register` expects."""
    tarball, _ = standin_tarball(root)
    directory = root / "runner"
    directory.mkdir()
    with tarfile.open(tarball) as archive:
        archive.extractall(directory)  # our own two files
    for path in [directory, *directory.rglob("*")]:
        os.lchown(path, account.uid, -1)
    return directory


def _job(queue: Path, steps: list[dict[str, Any]], files: dict[str, str]) -> Path:
    """A job file as the fake GitHub's broker hands it out (tests/fleet/fleet_fakes.py), with no webhook."""
    for sub in ("jobs", "claimed"):
        (queue / sub).mkdir(parents=True, exist_ok=True)
        (queue / sub).chmod(0o777)
    job = {"job_id": 1, "run_id": RUN_ID, "run_attempt": 1, "repository": "listendev/lstn", "job": "check",
           "workflow_ref": "listendev/lstn/.github/workflows/ci.yml@refs/heads/main", "event": "pull_request_target",
           "event_payload": json.loads(FORK_PR.read_text()), "steps": steps, "files": files, "python": str(PYTHON),
           "action": str(ROOT / "action.yml")}
    path = queue / "jobs" / "000001.json"
    path.write_text(json.dumps(job))
    path.chmod(0o666)
    return path


def test_a_registered_runner_submits_only_for_its_reported_job(account: Account, rig_root: Path) -> None:
    from runner.cli import main
    from runner.service.config.reading import load_config
    from runner.service.host.assembly import ServiceHost

    path = _config(rig_root, account, local_jobs={"repository": "local/jobs"})
    directory = _runner_dir(rig_root, account)
    assert main(["runner", "credential", "--runner-dir", str(directory), "--name", NAME, "--repository", "listendev/lstn",
                 "--hooks-dir", str(rig_root / "hooks"), "--service-config", str(path)]) == 0
    env_file = directory / ".env"
    socket = str(rig_root / "api.sock")
    requests = [["submit", spec("octo-org/other")], ["submit", spec()]]
    _job(rig_root / "queue", [{"run": f"\"$MICROVM_CHECK_PYTHON\" -I probe.py '{json.dumps(requests)}' {socket}"}],
         {"probe.py": PROBE.read_text()})
    jit = base64.b64encode(json.dumps({"queue": str(rig_root / "queue"), "name": NAME, "runner_id": 1}).encode())
    with ServiceHost(load_config(path), sandboxes=_no_vms, origin=str(path)) as host:
        done = subprocess.run(["./run.sh"], cwd=directory, user=account.uid, group=account.group,
                              extra_groups=[account.group], capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "ACTIONS_RUNNER_INPUT_JITCONFIG": jit.decode()})
        assert done.returncode == 0, done.stderr
        result = json.loads(wait_until(lambda: list((rig_root / "queue" / "claimed").glob("*.json")), 10,
                                       "the job's result")[0].read_text())["result"]
        answers = [json.loads(line.split(" ", 1)[1]) for line in result["log"].splitlines()
                   if line.startswith("probe ")]
        own = host.service.get(answers[1]["id"]) if answers[1]["status"] == 201 else None
        member = probe(account, Path(socket), [["submit", spec("octo-org/other")]])[0]
        local = host.service.get(member["id"]) if member["status"] == 201 else None
        # The job ended (its completed hook): the credential waits for the next job, the binding is gone.
        again = probe(account, Path(socket), [["submit", spec()]], _token(env_file))[0]
    assert (env_file.stat().st_uid, env_file.stat().st_mode & 0o777) == (account.uid, 0o600)
    assert [a["status"] for a in answers] == [403, 201], result["log"]
    assert (f"runner {NAME} runs listendev/lstn run {RUN_ID}/1 job check, but this submit is for octo-org/other"
            in answers[0]["error"])
    assert own is not None and own.repository == "listendev/lstn"
    assert local is not None and local.repository == "local/jobs"  # not the repository the member named
    assert again["status"] == 403 and "has not reported a job" in again["error"]


def _token(env_file: Path) -> str:
    return next(line.split("=", 1)[1] for line in env_file.read_text().splitlines()
                if line.startswith("MICROVM_CHECK_RUNNER_TOKEN="))


def _no_vms(request: Any) -> Any:
    raise AssertionError("no job here gets a checkout: no VM may be created")


def test_the_fleet_registers_its_runners_with_the_labels_of_the_size_classes_offered() -> None:
    from runner.fleet.model import FleetSettings
    from runner.service.config.reading import config_from_mapping

    config = config_from_mapping({"runners": {"org": "octo-org", "labels": ["self-hosted", "microvm"],
                                              "github_config": "/nonexistent/github.yml"},
                                  "sizes": {"large": {"vcpus": 2}, "xl": {"vcpus": 4, "memory_mib": 8192}}})
    assert FleetSettings.from_config(config).labels == ("self-hosted", "microvm", "size-large", "size-xl")
