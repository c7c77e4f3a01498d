"""The job's effective egress: the operator's store narrowed by the job, never widened; networking gates."""

from __future__ import annotations

from pathlib import Path

import pytest
from service_fakes import FakeEngine, checkout_tar, prints, spec

from policy import DENY_ALL, load_policy
from runner.service.egress import EgressPolicies, EgressPolicyError
from runner.service.service import JobError

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


def test_the_record_names_the_effective_policy(make_service, engine: FakeEngine, store: Path) -> None:
    engine.programs["ok"] = prints(b"")
    service = make_service(policy_dir=str(store), network={"enabled": True})
    rec = service.submit(spec("ok", policy=NARROWER))
    service.put_checkout(rec.id, [checkout_tar()])
    for _ in service.log_of(rec.id).follow():
        pass
    assert service.get(rec.id).policy_digest == load_policy(NARROWER).digest()
    kwargs = engine.created[0].kwargs
    assert kwargs["network"] is True and kwargs["policy"] == load_policy(NARROWER)


def test_deny_all_vms_get_no_network_card(make_service, engine: FakeEngine, store: Path) -> None:
    engine.programs["ok"] = prints(b"")
    service = make_service(policy_dir=str(store))
    rec = service.submit(spec("ok", repository="octo/unlisted"))
    service.put_checkout(rec.id, [checkout_tar()])
    for _ in service.log_of(rec.id).follow():
        pass
    assert engine.created[0].kwargs["network"] is False


def test_egress_without_networking_is_refused_at_submit(make_service, store: Path) -> None:
    service = make_service(policy_dir=str(store))
    with pytest.raises(JobError) as err:
        service.submit(spec("ok"))
    assert err.value.status == 400 and "network.enabled is false" in str(err.value)
    service.submit(spec("ok", policy="version: 1\nallow: []\n"))  # narrowed to nothing: fine


def test_invalid_job_policy_is_a_400(make_service, store: Path) -> None:
    service = make_service(policy_dir=str(store))
    with pytest.raises(JobError) as err:
        service.submit(spec("ok", policy="version: 1\nallow:\n  - host: x\n    ports: [70000]\n"))
    assert err.value.status == 400 and "job policy" in str(err.value)
