"""The job's effective egress: the operator's store narrowed by the job, never widened; networking gates."""

from __future__ import annotations

import base64
import hashlib
import html
from pathlib import Path

import pytest
import responses
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from policy import DENY_ALL, load_policy
from runner.github.client import GitHubClient
from runner.github.policy_source import PolicySource
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.api.refusals import status_of
from runner.service.jobs.admission import InvalidJob
from runner.service.jobs.egress import EgressPolicies, EgressPolicyError
from tests.github.github_fakes import (
    API,
    CONTENTS_FILE,
    CONTENTS_OP,
    INSTALLATION_ID,
    TOKEN_OP,
    example,
    load_operations,
    load_payload,
)
from tests.service.service_fakes import checkout_tar, spec

REPO_POLICY = "version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n  - host: files.pythonhosted.org\n    ports: [443]\n"
NARROWER = "version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n"
WIDER = "version: 1\nallow:\n  - host: evil.example\n    ports: [443]\n"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    (tmp_path / "octo").mkdir()
    (tmp_path / "octo" / "hello.yml").write_text(REPO_POLICY)
    return tmp_path


def test_job_policy_narrows_the_repository_policy(store: Path) -> None:
    policies = EgressPolicies(store)
    assert policies.effective("octo/hello", None) == load_policy(REPO_POLICY)
    assert policies.effective("octo/hello", NARROWER) == load_policy(NARROWER)
    assert policies.effective("octo/hello", WIDER).rules == ()
    assert policies.effective("octo/other", WIDER) == DENY_ALL  # no file for it: deny all


def test_without_a_store_everything_is_denied(tmp_path: Path) -> None:
    assert EgressPolicies(None).effective("octo/hello", WIDER) == DENY_ALL
    with pytest.raises(EgressPolicyError, match="policy: "):
        EgressPolicies(None).effective("octo/hello", "version: 1\nallow: 7\n")


def test_local_runs_trust_their_own_policy() -> None:
    assert EgressPolicies(None, trust_job_policy=True).effective("local/x", NARROWER) == load_policy(NARROWER)
    assert EgressPolicies(None, trust_job_policy=True).effective("local/x", None) == DENY_ALL


def test_the_record_names_the_effective_policy(make_service, engine: FakeSandboxes, store: Path) -> None:
    engine.programs["ok"] = prints(b"")
    service = make_service(policy_dir=str(store), network={"enabled": True})
    rec = service.submit(spec("ok", policy=NARROWER))
    service.put_checkout(rec.id, [checkout_tar()])
    for _ in service.log_of(rec.id).follow():
        pass
    assert service.get(rec.id).policy_digest == load_policy(NARROWER).digest()
    request = engine.created[0].request
    assert request.network is True and request.policy == load_policy(NARROWER)


def test_deny_all_vms_get_no_network_card(make_service, engine: FakeSandboxes, store: Path) -> None:
    engine.programs["ok"] = prints(b"")
    service = make_service(policy_dir=str(store))
    rec = service.submit(spec("ok", repository="octo/unlisted"))
    service.put_checkout(rec.id, [checkout_tar()])
    for _ in service.log_of(rec.id).follow():
        pass
    assert engine.created[0].request.network is False


def test_egress_without_networking_is_refused_at_submit(make_service, store: Path) -> None:
    service = make_service(policy_dir=str(store))
    with pytest.raises(InvalidJob, match=r"allows network access, but this service runs VMs without networking "
                                         r"\(network\.enabled is false in its config\)") as err:
        service.submit(spec("ok"))
    assert status_of(err.value) == 400
    service.submit(spec("ok", policy="version: 1\nallow: []\n"))  # narrowed to nothing: fine


def test_invalid_job_policy_is_a_400(make_service, store: Path) -> None:
    service = make_service(policy_dir=str(store))
    with pytest.raises(InvalidJob, match=r"^invalid job: policy: job policy") as err:
        service.submit(spec("ok", policy="version: 1\nallow:\n  - host: x\n    ports: [70000]\n"))
    assert status_of(err.value) == 400


BRANCH_POLICY = "version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n  - host: github.com\n    ports: [443]\n"
BRANCH_REPO = "listendev/lstn"  # the repository of the real pull request payloads
BRANCH_FILE = f"{API}/repos/{BRANCH_REPO}/contents/.github/microvm-check.yml"


def branch_file(text: str) -> dict:
    """The documented contents answer for a file, carrying `text`."""
    body = example(load_operations(), CONTENTS_OP, "200", CONTENTS_FILE)
    data = text.encode()
    body.update(content=base64.b64encode(data).decode(), size=len(data),
                sha=hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(),
                name="microvm-check.yml", path=".github/microvm-check.yml")
    return body


def on_github(text: str | None) -> None:
    """GitHub as the service sees it: the repository (from a real delivery) and its policy file."""
    repository = load_payload("listendev-lstn.pull_request.opened.from-fork.json")["repository"]
    responses.get(f"{API}/repos/{BRANCH_REPO}", json=repository)
    if text is None:
        responses.get(BRANCH_FILE, status=404, json={"message": "Not Found"})
    else:
        responses.get(BRANCH_FILE, json=branch_file(text))


def branch_source() -> PolicySource:
    return PolicySource(GitHubClient(lambda: "ghs_installation_token", sleep=lambda _: None))


@responses.activate
def test_the_store_comes_first_and_github_is_not_asked(tmp_path: Path) -> None:
    (tmp_path / "listendev").mkdir()
    (tmp_path / "listendev" / "lstn.yml").write_text(REPO_POLICY)
    policies = EgressPolicies(tmp_path, branch_files=branch_source())
    assert policies.effective(BRANCH_REPO, None) == load_policy(REPO_POLICY)
    assert len(responses.calls) == 0


@responses.activate
def test_without_a_store_file_the_default_branch_file_applies_within_the_org_default(tmp_path: Path) -> None:
    (tmp_path / "_org.yml").write_text(REPO_POLICY)  # pypi.org and files.pythonhosted.org
    on_github(BRANCH_POLICY)  # pypi.org and github.com
    policies = EgressPolicies(tmp_path, branch_files=branch_source())
    effective = policies.effective(BRANCH_REPO, None)
    assert effective.allows(443, "tcp", name="pypi.org")
    assert not effective.allows(443, "tcp", name="github.com")  # the org default does not allow it
    assert not effective.allows(443, "tcp", name="files.pythonhosted.org")  # the repository does not ask for it
    assert EgressPolicies(None, branch_files=branch_source()).effective(BRANCH_REPO, NARROWER) == load_policy(NARROWER)


@responses.activate
def test_a_repository_without_any_policy_file_gets_nothing(tmp_path: Path) -> None:
    on_github(None)
    assert EgressPolicies(None, branch_files=branch_source()).effective(BRANCH_REPO, WIDER) == DENY_ALL


@responses.activate
def test_github_failing_is_a_clear_policy_error(tmp_path: Path) -> None:
    responses.get(f"{API}/repos/{BRANCH_REPO}", status=404, json={"message": "Not Found"})
    unreadable = r"cannot read listendev/lstn's \.github/microvm-check\.yml from GitHub.*install the App"
    with pytest.raises(EgressPolicyError, match=unreadable):
        EgressPolicies(None, branch_files=branch_source()).effective(BRANCH_REPO, None)
    on_github("version: 1\nallow: 7\n")
    with pytest.raises(EgressPolicyError, match=r"listendev/lstn:\.github/microvm-check\.yml@main"):
        EgressPolicies(None, branch_files=branch_source()).effective(BRANCH_REPO, None)


@responses.activate
def test_the_service_reads_policies_from_default_branches_with_its_app(make_service, engine: FakeSandboxes,
                                                                       tmp_path: Path) -> None:
    """End to end: service config github_config -> App token -> the default branch's file -> the job's VM."""
    key = tmp_path / "app.pem"
    key.write_bytes(rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    settings = tmp_path / "github.yml"
    settings.write_text(f"app_id: 1\nprivate_key_path: {key}\ninstallation_id: {INSTALLATION_ID}\n")
    token = example(load_operations(), TOKEN_OP, "201") | {"expires_at": "2100-01-01T00:00:00Z"}
    responses.post(f"{API}/app/installations/{INSTALLATION_ID}/access_tokens", json=token, status=201)
    on_github(BRANCH_POLICY)
    engine.programs["ok"] = prints(b"")
    service = make_service(github_config=str(settings), network={"enabled": True})

    rec = service.submit(spec("ok", repository=BRANCH_REPO))

    assert rec.policy_digest == load_policy(BRANCH_POLICY).digest()
    assert responses.calls[-1].request.headers["Authorization"] == f"Bearer {token['token']}"


def test_a_job_policy_narrowed_to_nothing_says_so_in_the_record_summary_and_page(make_service, engine: FakeSandboxes,
                                                                                 store: Path) -> None:
    """The job asks for pypi.org:443 and its repository allows nothing: it runs with no egress, and
    its record, step summary and job page say in words what it asked for and did not get."""
    from action.summary import Result, markdown
    from runner.jobapi.contract import JobRecord
    from runner.service.api import page as web

    engine.programs["ok"] = prints(b"")
    service = make_service(policy_dir=str(store), network={"enabled": True})
    rec = service.submit(spec("ok", repository="octo/unlisted", policy=NARROWER))
    service.put_checkout(rec.id, [checkout_tar()])
    for _ in service.log_of(rec.id).follow():
        pass

    record = service.get(rec.id)
    assert record.policy_digest == DENY_ALL.digest() and record.narrowed_egress == ["pypi.org tcp/443"]
    assert JobRecord.from_wire(record.to_wire()).narrowed_egress == ["pypi.org tcp/443"]
    summary = markdown(Result(record=record, exit_code=0, junit=None, artifacts=[], refused_artifacts=[]))
    words = "The job's policy asked for pypi.org tcp/443, but the repository's policy allows none of it"
    assert f"> **Egress narrowed away:** {words}" in html.unescape(summary)  # as GitHub shows it
    assert words in html.unescape(web.job_page(service, rec.id).body.decode())
    ok = service.submit(spec("ok", repository="octo/hello", policy=NARROWER))  # within the repository's: nothing said
    assert service.get(ok.id).narrowed_egress == []
