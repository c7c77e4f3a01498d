"""The job service end to end on networked real VMs: where a job's egress policy comes from, and what
the record says it blocked, proven by the traffic of a guest on a fake internet the test builds.

Each test runs a `ServiceHost` (as `serve` does) whose network slots hang off the test's own fake
internet (tests/e2e/fake_internet.py); the guest dials addresses only and prints which answered.
Needs root, QEMU, network namespaces and the built `base` template: failing under CI=true.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jwt
import pytest
import responses
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from policy import load_policy
from runner.github.jobs import QueuedJob
from runner.jobapi.client import JobClient
from runner.jobapi.contract import JobRecord
from runner.service.config.reading import config_from_mapping
from tests.e2e.fake_internet import (
    ALLOWED_HOST,
    DENIED_HOST,
    METADATA,
    PROBE,
    cidr_policy,
    fake_internet,
    probed,
    reached,
)
from tests.e2e.vm_jobs import output, submit, templates, vm_root  # noqa: F401 (fixtures)
from tests.github.github_fakes import API, INSTALLATION_ID, TOKEN_OP, example, load_operations
from tests.service.jobs.test_egress import BRANCH_REPO, on_github

pytestmark = pytest.mark.vm

ALLOWED = f"{ALLOWED_HOST}:8000"
DENIED = f"{DENIED_HOST}:8000"
THE_METADATA = f"{METADATA}:80"


@pytest.fixture
def net_host(need_netns: None, vm_root: Path) -> Iterator[Callable[..., Any]]:
    """Started networked `ServiceHost`s on a fake internet; at teardown a VM that outlived its service,
    or a namespace or link of the test left behind, fails the test."""
    from runner.service.host.assembly import ServiceHost

    with ExitStack() as stack:
        internet = stack.enter_context(fake_internet())

        def make(**settings: Any) -> ServiceHost:
            config = config_from_mapping({"socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"),
                                          "shutdown_grace_seconds": 0, "network": internet.network, **settings})
            host = stack.enter_context(ServiceHost(config, engine=internet.engine(pool_size=0)))
            stack.callback(_no_vm_outlives, host)  # runs before the host closes
            return host

        yield make


def _no_vm_outlives(host: Any) -> None:
    host.service.drain()
    assert host.engine.live() == [], "a job's VM outlived the service"


def probe_job(client: JobClient, *targets: str, **fields: Any) -> tuple[JobRecord, str]:
    """Run the probe against `targets` in a job; its final record and output."""
    job = submit(client, f"python3 probe.py {' '.join(targets)}", files={"probe.py": PROBE.encode()},
                 timeout_seconds=300, **fields)
    text = output(client, job).decode()
    record = client.get(job)
    assert (record.state, record.exit_code) == ("finished", 0), (record, text)
    assert probed(text) == set(targets), text  # the probe ran to its end: every result below is real
    return record, text


def test_a_prewarmed_vm_is_not_handed_out_after_its_repository_policy_changed(net_host, tmp_path: Path) -> None:
    """A VM's egress rules are fixed when it is restored: one warmed under the old policy must not run a
    job that now has another (PrewarmedVMs.claim compares the policy digest)."""
    store = tmp_path / "policies"
    (store / "octo").mkdir(parents=True)
    old, new = cidr_policy(DENIED), cidr_policy(ALLOWED)
    (store / "octo" / "hello.yml").write_text(old)
    host = net_host(policy_dir=str(store), prewarm={"max_vms": 1})
    service, client = host.service, JobClient(socket=host.config.socket)
    host.reactions.prewarm(QueuedJob(repository="octo/hello", run_id=4242, run_attempt=1, job_id=1, job_name="test",
                              labels=("microvm",)))
    (warm,) = list(service.prewarmed._vms)
    assert warm.ready.wait(300) and warm.sandbox is not None
    assert warm.policy_digest == load_policy(old).digest()

    (store / "octo" / "hello.yml").write_text(new)  # the operator edits the repository's policy
    record, text = probe_job(client, ALLOWED, DENIED, run_id=4242, run_attempt=1)

    assert reached(text) == {ALLOWED}, text  # the new rules; the warm VM would have reached DENIED only
    assert record.warm is False and record.vm_id != warm.sandbox.id
    assert record.policy_digest == load_policy(new).digest()


@responses.activate
def test_the_default_branch_policy_is_what_the_job_vm_gets(net_host, tmp_path: Path) -> None:
    """No store file: the repository's `.github/microvm-check.yml` on its default branch, read with the
    service's GitHub App (installation token, then the contents API), is the VM's policy."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = tmp_path / "app.pem"
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    settings = tmp_path / "github.yml"
    settings.write_text(f"app_id: 1\nprivate_key_path: {pem}\ninstallation_id: {INSTALLATION_ID}\n")
    token = example(load_operations(), TOKEN_OP, "201") | {"expires_at": "2100-01-01T00:00:00Z"}
    token_call = responses.post(f"{API}/app/installations/{INSTALLATION_ID}/access_tokens", json=token, status=201)
    branch_policy = cidr_policy(ALLOWED)
    on_github(branch_policy)  # the repository (from a real delivery) and its file on the default branch
    host = net_host(github_config=str(settings))  # and no policy_dir: only GitHub can give a policy

    record, text = probe_job(JobClient(socket=host.config.socket), ALLOWED, DENIED, repository=BRANCH_REPO)

    assert reached(text) == {ALLOWED}, text  # deny-all (no file read) would reach nothing
    assert record.policy_digest == load_policy(branch_policy).digest()
    (asked,) = token_call.calls  # as the App: a JWT it signed, for this installation
    claims = jwt.decode(asked.request.headers["Authorization"].removeprefix("Bearer "), key.public_key(),
                        algorithms=["RS256"])
    assert claims["iss"] in (1, "1")
    contents = [c for c in responses.calls if c.request.url.startswith(f"{API}/repos/{BRANCH_REPO}/contents/")]
    assert contents and all(c.request.headers["Authorization"] == f"Bearer {token['token']}" for c in contents)


def test_blocked_egress_reaches_the_record_in_block_and_audit_mode(net_host, tmp_path: Path) -> None:
    """What the guest dialled and its policy does not allow is in the job's record, with the reason:
    in block mode it was stopped, in audit mode it went through (public) and is still listed; the
    metadata service is always denied."""
    store = tmp_path / "policies"
    (store / "octo").mkdir(parents=True)
    (store / "octo" / "blocking.yml").write_text(cidr_policy(ALLOWED))
    (store / "octo" / "auditing.yml").write_text(cidr_policy(ALLOWED, mode="audit"))
    host = net_host(policy_dir=str(store))
    client = JobClient(socket=host.config.socket)
    targets = (ALLOWED, DENIED, THE_METADATA)

    blocking, block_text = probe_job(client, *targets, repository="octo/blocking")
    auditing, audit_text = probe_job(client, *targets, repository="octo/auditing")

    assert reached(block_text) == {ALLOWED} and reached(audit_text) == {ALLOWED, DENIED}
    for record in (blocking, auditing):
        listed = {(b.dest, b.port, b.proto): b.reason for b in record.blocked_egress}
        assert listed[(DENIED_HOST, 8000, "tcp")] == "policy", listed
        assert listed[(METADATA, 80, "tcp")] == "always-denied", listed
        assert (ALLOWED_HOST, 8000, "tcp") not in listed, listed
        assert all(b.count >= 1 for b in record.blocked_egress)
