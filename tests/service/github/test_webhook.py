"""The service as the GitHub webhook's job hooks: real deliveries in, warm VMs out (over loopback)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import requests

from runner.github.signature import sign
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.config.reading import ConfigError
from runner.service.github.webhook import start_webhook
from tests.reference import captured
from tests.service.service_fakes import checkout_tar, spec

SECRET = b"webhook-test-secret"
QUEUED = "github-aws-runners.workflow_job.queued.self-hosted.json"
COMPLETED = "tarantool-job-rerunner@a5e5a579.workflow_job.completed.failure.runner-tntmac06.json"


@pytest.fixture
def webhook(make_host, engine: FakeSandboxes, tmp_path: Path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    host = make_host()
    server = start_webhook({"listen": "127.0.0.1:0", "secret_path": str(secret), "labels": ["microvm"]}, host.reactions)
    yield host.service, f"http://127.0.0.1:{server.port}/github/webhook"
    server.close()


def deliver(url: str, payload: dict) -> requests.Response:
    body = json.dumps(payload).encode()
    return requests.post(url, data=body, timeout=30, headers={
        "Content-Type": "application/json", "X-GitHub-Event": "workflow_job",
        "X-GitHub-Delivery": str(uuid.uuid4()), "X-Hub-Signature-256": sign(SECRET, body)})


def test_queued_delivery_prewarms_and_the_submit_claims_it(webhook, engine: FakeSandboxes) -> None:
    service, url = webhook
    engine.programs["ok"] = prints(b"")
    payload = captured(QUEUED)
    assert deliver(url, payload).status_code == 200
    for vm in service.prewarmed._vms:
        vm.ready.wait(10)
    assert service.prewarmed.count() == 1
    job = payload["workflow_job"]
    rec = service.submit(spec("ok", repository=payload["repository"]["full_name"], run_id=job["run_id"],
                              run_attempt=job.get("run_attempt") or 1))
    service.put_checkout(rec.id, [checkout_tar()])
    for _ in service.log_of(rec.id).follow():
        pass
    assert service.get(rec.id).warm is True
    assert engine.alive() == []


def test_completed_delivery_destroys_the_unclaimed_vm(webhook, engine: FakeSandboxes) -> None:
    service, url = webhook
    queued = captured(QUEUED)
    assert deliver(url, queued).status_code == 200
    for vm in service.prewarmed._vms:
        vm.ready.wait(10)
    completed = captured(COMPLETED)
    # The same real shape, pointed at the job that was queued above.
    for key in ("id", "run_id", "run_attempt", "labels"):
        completed["workflow_job"][key] = queued["workflow_job"].get(key) or (1 if key == "run_attempt" else None)
    completed["repository"] = queued["repository"]
    assert deliver(url, completed).status_code == 200
    assert service.prewarmed.count() == 0
    assert engine.alive() == [] and len(engine.created) == 1


def test_webhook_settings_are_checked(make_host, tmp_path: Path) -> None:
    service = make_host().reactions
    assert start_webhook({}, service) is None
    with pytest.raises(ConfigError, match="secret_path: required"):
        start_webhook({"listen": "127.0.0.1:0"}, service)
    with pytest.raises(ConfigError, match="cannot read"):
        start_webhook({"listen": "127.0.0.1:0", "secret_path": str(tmp_path / "none")}, service)
    with pytest.raises(ConfigError, match="webhook.port: unknown setting"):
        start_webhook({"listen": "127.0.0.1:0", "port": 1}, service)


def test_redelivery_sweep_runs_beside_the_endpoint_and_stops_with_it(make_host, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = tmp_path / "app.pem"
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    github = tmp_path / "github.yml"
    github.write_text(f"client_id: Iv1.test\nprivate_key_path: {pem}\norg: octo\n")
    base = {"listen": "127.0.0.1:0", "secret_path": str(secret)}
    service = make_host().reactions
    with pytest.raises(ConfigError, match="at least 30"):
        start_webhook({**base, "redeliver_every": 5, "github_config": str(github)}, service)
    with pytest.raises(ConfigError, match="needs the GitHub App settings"):
        start_webhook({**base, "redeliver_every": 300, "github_config": str(tmp_path / "missing.yml")}, service)
    webhook = start_webhook({**base, "redeliver_every": 300, "github_config": str(github)}, service)
    assert webhook.sweep.is_alive()
    webhook.close()
    assert not webhook.sweep.is_alive()
