"""GitHub down while a job's policy must be read from its default branch: the API answers 503 with
Retry-After (before: `400 invalid job`, which no client retries), and the client (the action, `run`) says
once that it waits, then gets its job in when GitHub is back."""

from __future__ import annotations

from pathlib import Path

import pytest
import responses
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from runner.github.client import RetryPolicy
from runner.jobapi.client import JobAPIError, JobClient
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.jobs.egress import PolicySourceUnavailable
from tests.github.github_fakes import API, INSTALLATION_ID, TOKEN_OP, example, load_operations, load_payload
from tests.service.jobs.test_egress import BRANCH_FILE, BRANCH_POLICY, BRANCH_REPO, branch_file
from tests.service.service_fakes import spec


def _app(tmp_path: Path) -> Path:
    key = tmp_path / "app.pem"
    key.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    settings = tmp_path / "github.yml"
    settings.write_text(f"app_id: 1\nprivate_key_path: {key}\ninstallation_id: {INSTALLATION_ID}\n")
    token = example(load_operations(), TOKEN_OP, "201") | {"expires_at": "2100-01-01T00:00:00Z"}
    responses.post(f"{API}/app/installations/{INSTALLATION_ID}/access_tokens", json=token, status=201)
    return settings


@responses.activate
def test_github_down_is_503_with_retry_after_and_the_client_waits_it_out(
        api, engine: FakeSandboxes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RetryPolicy, "backoff", lambda self, attempt: 0.01)  # GitHub's own retries, quickly
    engine.programs["ok"] = prints(b"fine\n")
    service, _ = api(github_config=str(_app(tmp_path)), network={"enabled": True})
    down = responses.get(f"{API}/repos/{BRANCH_REPO}", status=502, body="Bad Gateway")

    impatient = JobClient(socket=service.config.socket, retry_statuses=frozenset())
    with pytest.raises(JobAPIError) as refused:
        impatient.submit(spec("ok", repository=BRANCH_REPO))
    assert refused.value.status == 503 and refused.value.retry_after == PolicySourceUnavailable.retry_after
    assert "GitHub is unavailable" in str(refused.value) and "invalid job" not in str(refused.value)

    said: list[str] = []
    client = JobClient(socket=service.config.socket, say=said.append, retry_seconds=600)

    def github_comes_back(seconds: float) -> None:
        assert seconds >= PolicySourceUnavailable.retry_after  # as the service asked
        responses.remove(down)
        repository = load_payload("listendev-lstn.pull_request.opened.from-fork.json")["repository"]
        responses.get(f"{API}/repos/{BRANCH_REPO}", json=repository)
        responses.get(BRANCH_FILE, json=branch_file(BRANCH_POLICY))
    client._sleep = github_comes_back
    summary = client.submit(spec("ok", repository=BRANCH_REPO))
    assert len(said) == 1 and "503" in said[0] and "retrying as the service asks" in said[0]
    assert service.get(summary.id).repository == BRANCH_REPO
