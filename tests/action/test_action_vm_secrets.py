"""The action's `secrets:` input end to end (issue 35): action.yml as the runner runs it, a registered runner's
credential, the real service, real VMs in a fake internet with a real TLS package index behind basic auth.

Under `pull_request_target` (the base branch's workflow) the binding's value comes from the step's env (as
`${{ secrets.X }}` would), the guest installs from the private index with only its placeholder, the index gets
the real credential, and the value is then looked for everywhere: the guest's environment (an artifact the
guest wrote, which no mask touches), the step's log, summary and outputs, the job record, the signed record,
every file of the service's state (records database, job log), the service log and its health answer. The
record and the signed record list the binding (name, host, source, requests). Under `pull_request` (a workflow
the pull request may have written) the same input binds nothing and the step says why; so does a policy file
of the checkout (the pull request's) that tries to add a binding.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from runner.jobapi.client import JobClient
from runner.jobapi.contract import GitHubJob, JobStarted
from tests.action.action_harness import Simulation, run_action
from tests.conftest import require
from tests.net import net_fakes
from tests.net.secret_fakes import INSTALL, REAL_AUTH, VALUE, PrivateIndex, secret_internet

pytestmark = pytest.mark.vm

REPOSITORY = "octo/hello"
RUNNER = "mvc-action-secrets"
STORE_POLICY = "version: 1\nallow:\n  - host: idx.test\n    ports: [8443]\n"
SECRETS_INPUT = """\
index:
  env: INDEX_PASSWORD
  host: idx.test
  ports: [8443]
  paths: ["/simple/*", "/files/*", "/echo/*"]
  scheme: basic
  user: ci
  value-from: INDEX_VALUE
"""
# What the guest holds: its environment and every process's, into an artifact (artifacts are not masked).
DUMP = "mkdir -p out && env > out/env.txt && cat /proc/*/environ > out/environ.bin 2>/dev/null; true"


def event(same_repository_head: bool) -> dict[str, Any]:
    head = REPOSITORY if same_repository_head else "fork/hello"
    return {"pull_request": {"number": 7, "author_association": "MEMBER", "merge_commit_sha": "e" * 40,
                             "head": {"sha": "a" * 40, "repo": {"full_name": head}},
                             "base": {"sha": "b" * 40, "repo": {"full_name": REPOSITORY}}}}


@pytest.fixture
def vm_root() -> Iterator[Path]:
    """A private engine root whose templates are the built ones (read only)."""
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateNotFound, TemplateStore

    try:
        TemplateStore(StateDir.default().templates).get("base")
    except TemplateNotFound as exc:
        require(False, str(exc))
    root = Path(tempfile.mkdtemp(prefix="mvc-act-sec-", dir="/tmp"))
    (root / "state").mkdir()
    os.symlink(StateDir.default().templates, root / "state" / "templates")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def rig(need_netns: None, vm_root: Path, tmp_path: Path) -> Iterator[tuple[Any, str]]:
    """(the service host, the registered runner's token)."""
    import yaml

    from runner.cli import main
    from runner.net import NamespaceUplink, Upstream
    from runner.service.config.reading import load_config
    from runner.service.host.assembly import EngineSettings, ServiceHost

    with ExitStack() as stack:
        prefix = "a" + secrets.token_hex(3)
        internet, ca_file = secret_internet(prefix, tmp_path, stack)
        (vm_root / "policies" / "octo").mkdir(parents=True)
        (vm_root / "policies" / "octo" / "hello.yml").write_text(STORE_POLICY)
        path = vm_root / "service.yml"
        path.write_text(yaml.safe_dump({
            "socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"), "shutdown_grace_seconds": 0,
            "policy_dir": str(vm_root / "policies"),
            "network": {"enabled": True, "slot_prefix": prefix, "upstream_ca": str(ca_file)}}))
        (vm_root / "runner").mkdir()
        assert main(["runner", "credential", "--runner-dir", str(vm_root / "runner"), "--name", RUNNER, "--hooks-dir",
                     str(vm_root / "hooks"), "--service-config", str(path), "--repository", REPOSITORY]) == 0
        token = next(line.split("=", 1)[1] for line in (vm_root / "runner" / ".env").read_text().splitlines()
                     if line.startswith("MICROVM_CHECK_RUNNER_TOKEN="))
        engine = EngineSettings(uplink=NamespaceUplink(internet), pool_size=0,
                                upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=internet))
        host = stack.enter_context(ServiceHost(load_config(path), engine=engine, origin=str(path)))
        yield host, token
        host.service.drain()
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def job(host: Any, token: str, tmp: Path, run_id: int, event_name: str, same_repository_head: bool,
        inputs: dict[str, str], files: dict[str, str] | None = None) -> tuple[Any, Simulation]:
    """The runner's job-started hook reports the job, the action runs as its step, the job-completed hook
    ends it: (the action's result, its simulation)."""
    pull = event(same_repository_head)["pull_request"]
    guard = {"event_name": event_name, "repository": REPOSITORY, "workflow_ref": "", "pull_request": pull}
    workspace, temp = tmp / f"ws-{run_id}", tmp / f"temp-{run_id}"
    workspace.mkdir()
    temp.mkdir()
    for name, text in (files or {}).items():
        (workspace / name).write_text(text)
    with JobClient(socket=host.config.socket, runner_token=token, retry_statuses=frozenset()) as hooks:
        verdict = hooks.job_started(JobStarted(GitHubJob(REPOSITORY, run_id, 1, "check"),
                                               f"{REPOSITORY}/.github/workflows/ci.yml@refs/heads/main", event_name,
                                               guard))
        assert verdict.allowed, verdict
        sim = Simulation(workspace, temp, event(same_repository_head), event_name=event_name,
                         extra_env={"INDEX_VALUE": VALUE, "MICROVM_CHECK_RUNNER_TOKEN": token,
                                    "GITHUB_RUN_ID": str(run_id), "MICROVM_CHECK_GUARD_RULES": ""})
        result = run_action(sim, {"socket": host.config.socket, **inputs}, timeout=900)
        hooks.job_completed()
    return result, sim


def test_a_base_branch_workflows_binding_installs_from_a_private_index_and_the_value_shows_nowhere(
        rig: tuple[Any, str], tmp_path: Path, vm_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    host, token = rig
    result, sim = job(host, token, tmp_path, 5001, "pull_request_target", False, {
        "run": f"{DUMP} && {INSTALL}", "secrets": SECRETS_INPUT, "artifacts": "out", "timeout-minutes": "10"})
    (record,) = host.service.list(limit=5)
    attestation = (sim.workspace / "artifacts" / "microvm-check.intoto.jsonl").read_text()
    statement = json.loads(base64.b64decode(json.loads(attestation)["payload"]))
    health = str(host.service.health())
    arrived = list(PrivateIndex.received)

    assert result.returncode == 0, result.log
    assert "installed from the fake index" in result.log
    assert "secret bindings: index in $INDEX_PASSWORD" in result.log
    used = record.secrets_used
    assert [(u["name"], u["host"], u["source"]) for u in used] == [("index", "idx.test", "workflow")], used
    assert used[0]["requests"] >= 2, used  # the index page and the file, each with the real credential
    assert statement["predicate"]["secretsUsed"] == used
    assert sum(REAL_AUTH in head for head in arrived) >= 2, "the index never got the real credential"
    env_txt = (sim.workspace / "artifacts" / "out" / "env.txt").read_text()
    assert "INDEX_PASSWORD=mvcsecret" in env_txt and "INDEX_VALUE" not in env_txt, env_txt
    auth = base64.b64encode(f"ci:{VALUE}".encode()).decode()
    texts = {"the step's log": result.log, "the step summary": result.summary, "the outputs": str(result.outputs),
             "the record": str(record.to_wire()), "the signed record": attestation, "the service log": caplog.text,
             "the health answer": health}
    for where, text in texts.items():
        assert VALUE not in text and auth not in text, where
    for root in (sim.workspace / "artifacts", vm_root / "state"):
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink() and "templates" not in path.parts:
                data = path.read_bytes()
                assert VALUE.encode() not in data and auth.encode() not in data, path


def test_a_pull_requests_workflow_or_policy_file_binds_nothing_and_is_told_so(
        rig: tuple[Any, str], tmp_path: Path) -> None:
    host, token = rig
    # `pull_request`: the workflow file, and so the input, may be the pull request's own
    own, _ = job(host, token, tmp_path, 5002, "pull_request", True, {"run": INSTALL, "secrets": SECRETS_INPUT})
    # `pull_request_target`, but the job's policy is a file of the checkout (the pull request's) adding a binding
    widened, _ = job(host, token, tmp_path, 5003, "pull_request_target", False, {"run": INSTALL, "policy": "mvc.yml"},
                     files={"mvc.yml": STORE_POLICY + "secrets:\n  - {name: index, host: idx.test, paths: ['/*']}\n"})
    jobs = host.service.list(limit=5)

    assert own.returncode != 0 and "the action's secrets: input (index) is not honoured" in own.log, own.log
    assert "'pull_request'" in own.log and "pull_request_target" in own.log
    assert widened.returncode != 0 and "a policy cannot bind secrets or widen a binding" in widened.log, widened.log
    assert jobs == [], "a refused job must not have been admitted"
    assert not any(REAL_AUTH in head for head in PrivateIndex.received)
    for result in (own, widened):
        assert VALUE not in result.log and VALUE not in result.summary
