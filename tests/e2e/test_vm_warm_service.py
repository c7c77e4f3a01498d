"""Warm bases in the running service (ServiceHost on real VMs): jobs through the job API, a pre-warmed VM,
a push webhook, the disk budget and the network variants.

GitHub is `responses` (tests/service/warm_fakes.py); the job API (httpx on a Unix socket) and the
webhook (http.client on loopback) are real sockets that `responses` does not see.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import responses

from runner.github.client import GitHubClient
from runner.github.jobs import QueuedJob
from runner.github.policy_source import PolicySource
from runner.jobapi.client import JobClient
from runner.service.config.reading import config_from_mapping
from runner.service.jobs.bases import base_name
from runner.service.jobs.egress import EgressPolicies
from tests.service.service_fakes import checkout_tar
from tests.service.warm_fakes import FIRST_COMMIT, POLICY, REPO, DefaultBranch
from tests.vm.conftest import template_store  # noqa: F401 - the built template fixture, as in tests/vm

pytestmark = pytest.mark.vm
SECRET = b"warm-service-webhook-secret"
SHA = "a" * 40
NONET = base_name("base", REPO, network=False)
NET = base_name("base", REPO, network=True)
# Finds the package setup installed, and says whether setup ran in this VM (it ran once, in the base build).
JOB = ("PYTHONPATH=/opt/warm python3 -c 'import tinypkg; print(tinypkg.VERSION)' 2>/dev/null || echo missing; "
       "cat /opt/setup-runs 2>/dev/null || echo no-setup; cat /workspace/requirements.txt")


@pytest.fixture
def host(template_store, tmp_path: Path) -> Iterator[Any]:
    """A ServiceHost on a private engine whose templates are the built `base` (linked) plus what it builds."""
    from runner.service.host.assembly import EngineSettings, ServiceHost
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore
    from tests.vm.conftest import assert_no_leftovers

    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "base").symlink_to(template_store.root / "base")
    secret = tmp_path / "webhook-secret"
    secret.write_bytes(SECRET)
    config = config_from_mapping({
        "socket": str(tmp_path / "api.sock"), "state_dir": str(tmp_path / "state"), "shutdown_grace_seconds": 0,
        "prewarm": {"max_vms": 1}, "bases": {"disk_budget": 0},  # nothing but the base just built may stay
        "webhook": {"listen": "127.0.0.1:0", "secret_path": str(secret), "labels": ["microvm"]},
    })
    github = PolicySource(GitHubClient(lambda: "ghs_installation_token", sleep=lambda _: None))
    state = StateDir(tmp_path / "state")
    responses.start()  # the default mock, which DefaultBranch.register fills
    try:
        with ServiceHost(config, engine=EngineSettings(state=state, templates=TemplateStore(templates), pool_size=0),
                         policies=EgressPolicies(None, branch_files=github)) as built:
            yield built
            built.service.drain()
            assert built.engine.live() == [], "a job's VM outlived the service"
    finally:
        responses.stop()
        responses.reset()
    assert_no_leftovers(state)


def run_job(client: JobClient, requirements: bytes, **fields: Any) -> tuple[list[str], list[str], Any]:
    """Submit a job of the repository through the API: its output lines, system notes and final record."""
    job = client.submit({"repository": REPO, "sha": SHA, "job_name": "test", "command": JOB, **fields}).id
    client.upload_checkout(job, checkout_tar({"requirements.txt": requirements}))
    entries = list(client.logs(job))
    out = b"".join(e.data for e in entries if e.stream == "stdout").decode().splitlines()
    notes = [e.data.decode() for e in entries if e.stream == "system"]
    return out, notes, client.get(job)


def push(port: int, commit: str) -> tuple[int, str]:
    """A signed `push` delivery of the default branch to the running service's webhook."""
    from tests.github.github_fakes import load_payload

    repository = load_payload("listendev-lstn.pull_request.opened.from-fork.json")["repository"]
    body = json.dumps({"ref": "refs/heads/main", "before": "0" * 39 + "1", "after": commit, "created": False,
                       "deleted": False, "forced": False, "commits": [], "repository": repository}).encode()
    signature = "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/github/webhook", body, {
            "Content-Type": "application/json", "X-GitHub-Event": "push", "X-GitHub-Delivery": str(uuid.uuid4()),
            "X-Hub-Signature-256": signature})
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read())["message"]
    finally:
        connection.close()


def test_jobs_and_prewarmed_vms_restore_from_the_base_which_a_push_rebuilds_within_the_budget(host) -> None:
    branch = DefaultBranch({".github/microvm-check.yml": POLICY, "requirements.txt": "tinypkg==1.0\n"})
    branch.register()
    service, bases, engine = host.service, host.service.vms.bases, host.engine
    client = JobClient(socket=host.config.socket)
    assert bases is not None and bases.settings.budget_bytes == 0

    # the first job finds no base: it runs on the bare template, and the base is built beside it
    out, notes, record = run_job(client, b"tinypkg==1.0\n")
    assert (record.state, record.exit_code) == ("finished", 0)
    assert out[:2] == ["missing", "no-setup"]
    assert not any("warm base" in note for note in notes)
    bases.wait(REPO, network=False, timeout=900)
    first = engine.templates.get(NONET)

    # a job through the API restores from it: the package is there and setup did not run in the job;
    # a pull request that changes requirements.txt still gets the default branch's base
    out, notes, record = run_job(client, b"tinypkg==2.0\nrequests\n")
    assert out == ["1.0", "ran", "tinypkg==2.0", "requests"]
    assert f"restoring from the repository's warm base {NONET}" in notes
    assert record.warm is False

    # a VM pre-warmed for a queued job of the repository is restored from the base and claimed by its submit
    host.reactions.prewarm(QueuedJob(repository=REPO, run_id=77, run_attempt=1, job_id=770, job_name="test",
                              labels=("microvm",)))
    [warmed] = list(service.prewarmed._vms)
    assert warmed.ready.wait(300) and warmed.sandbox is not None and warmed.template == NONET
    out, notes, record = run_job(client, b"tinypkg==1.0\n", run_id=77, run_attempt=1)
    assert out[:2] == ["1.0", "ran"]
    assert record.warm is True and record.vm_id == warmed.sandbox.id

    # another template made from a VM: the budget (0) leaves it only until the next build
    from runner.sandbox import Sandbox

    with Sandbox.create(template="base", engine=engine) as scratch:
        scratch.snapshot("scratch")
    assert {t.name for t in engine.templates.list()} == {"base", NONET, "scratch"}

    # a push to the default branch rebuilds the base from the branch's head (asked of GitHub: its tarball
    # names the commit); the budget evicts the rest
    commit = "7" * 40
    branch.push(commit, {"requirements.txt": "tinypkg==1.0\nattrs\n"})
    status, message = push(host.webhook.port, commit)
    assert (status, message) == (200, f"default branch of {REPO} at {commit[:12]}: its warm bases are rebuilt")
    bases.wait(REPO, network=False, timeout=900)
    second = engine.templates.get(NONET)
    assert second.digest != first.digest and second.manifest["base"]["commit"] == commit
    assert branch.tarball_refs[-1] == "main"
    assert {t.name for t in engine.templates.list()} == {"base", NONET}  # scratch: evicted
    out, notes, _ = run_job(client, b"tinypkg==1.0\n")
    assert out[:2] == ["1.0", "ran"] and f"restoring from the repository's warm base {NONET}" in notes


def test_a_base_of_one_network_variant_never_serves_the_other(host) -> None:
    """This service has no networking, so a job that needs a network card cannot run here; what it would
    get is asked of the bases directly: not the nonet base, and the build of the net one is started."""
    branch = DefaultBranch({".github/microvm-check.yml": POLICY, "requirements.txt": "tinypkg==1.0\n"})
    branch.register()
    bases, engine = host.service.vms.bases, host.engine
    client = JobClient(socket=host.config.socket)
    out, _, _ = run_job(client, b"tinypkg==1.0\n")  # builds the nonet base beside
    bases.wait(REPO, network=False, timeout=900)
    assert engine.templates.get(NONET).variants == ("nonet",)

    assert bases.template_for(REPO, network=True) == "base"
    bases.wait(REPO, network=True, timeout=300)  # it cannot be built here: this engine has no network
    assert NET not in {t.name for t in engine.templates.list()}
    assert bases.template_for(REPO, network=True) == "base"
    assert bases.template_for(REPO, network=False) == NONET
    from runner.vm.templates import TemplateNotFound

    with pytest.raises(TemplateNotFound, match="was snapshotted from a VM without a network card"):
        engine.templates.get(NONET).snapshot(network=True)  # what a restore of it with a network card reads


def test_a_replayed_push_leaves_the_base_as_it_was(host) -> None:
    """Once the delivery log has forgotten a signed push (24 h or 10,000 newer deliveries), its replay
    is accepted; the rebuild it asks for is of the default branch's head as GitHub reports it now,
    never of the commit the old delivery names (issue 16)."""
    branch = DefaultBranch({".github/microvm-check.yml": POLICY, "requirements.txt": "tinypkg==1.0\n"})
    branch.commits[FIRST_COMMIT] = dict(branch.commits["main"])  # the first commit stays fetchable by its id
    branch.register()
    bases, engine = host.service.vms.bases, host.engine
    bases.build(REPO, network=False)
    assert engine.templates.get(NONET).manifest["base"]["commit"] == FIRST_COMMIT

    commit = "7" * 40
    branch.push(commit, {"requirements.txt": "tinypkg==1.0\nattrs\n"})
    assert push(host.webhook.port, commit)[0] == 200
    bases.wait(REPO, network=False, timeout=900)
    current = engine.templates.get(NONET)
    assert current.manifest["base"]["commit"] == commit

    # The first push's delivery, replayed (a new delivery id: the log no longer knows the old one).
    assert push(host.webhook.port, FIRST_COMMIT)[0] == 200
    bases.wait(REPO, network=False, timeout=900)
    after = engine.templates.get(NONET)
    assert (after.digest, after.manifest["base"]["commit"]) == (current.digest, commit)
    assert FIRST_COMMIT not in branch.tarball_refs
