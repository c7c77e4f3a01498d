"""The operator's policy store: org default, repository files, deny-all, and hostile names."""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path

import pytest

from policy import DENY_ALL, PolicyError, PolicyStore, Rule

ORG = "version: 1\nallow:\n  - cidr: 10.0.0.0/8\n    ports: [80, 443]\n  - host: '*.pythonhosted.org'\n    ports: [443]\n"
REPO = "version: 1\nallow:\n  - cidr: 10.20.0.0/16\n    ports: [443, 8443]\n  - host: files.pythonhosted.org\n    ports: [443]\n"


@pytest.fixture
def store(tmp_path: Path) -> PolicyStore:
    (tmp_path / "octo").mkdir()
    (tmp_path / "octo" / "hello.yml").write_text(REPO)
    return PolicyStore(tmp_path)


def test_deny_all_when_neither_file_exists(store: PolicyStore):
    assert store.for_repository("someone/else") == DENY_ALL


def test_repository_file_alone_without_an_org_default(store: PolicyStore):
    assert store.for_repository("octo/hello").rules == (
        Rule(frozenset({443}), host="files.pythonhosted.org"),
        Rule(frozenset({443, 8443}), network=ip_network("10.20.0.0/16")),
    )


def test_org_default_alone_when_the_repository_has_no_file(store: PolicyStore):
    (store.directory / "_org.yml").write_text(ORG)
    assert store.for_repository("octo/other").rules == (
        Rule(frozenset({443}), host="*.pythonhosted.org"),
        Rule(frozenset({80, 443}), network=ip_network("10.0.0.0/8")),
    )


def test_repository_file_is_intersected_with_the_org_default(store: PolicyStore):
    (store.directory / "_org.yml").write_text(ORG)
    assert store.for_repository("octo/hello").rules == (
        Rule(frozenset({443}), host="files.pythonhosted.org"),
        Rule(frozenset({443}), network=ip_network("10.20.0.0/16")),
    )


def test_lookup_ignores_case_like_github(store: PolicyStore):
    assert store.for_repository("Octo/Hello") == store.for_repository("octo/hello") != DENY_ALL


def test_job_policy_only_narrows(store: PolicyStore):
    wider = "version: 1\nmode: audit\nallow:\n  - cidr: 0.0.0.0/0\n    ports: [22, 443]\n  - host: evil.example\n    ports: [443]\n"
    effective = store.for_job("octo/hello", wider)
    assert effective.mode == "block"
    assert effective.rules == (Rule(frozenset({443}), network=ip_network("10.20.0.0/16")),)
    assert store.for_job("octo/hello", None) == store.for_repository("octo/hello")


def test_invalid_job_policy_is_reported_against_the_job(store: PolicyStore):
    with pytest.raises(PolicyError, match=r"^job policy:1:10: version: 9 is not supported"):
        store.for_job("octo/hello", "version: 9\n")


def test_invalid_store_file_fails_loudly_instead_of_falling_back(store: PolicyStore):
    (store.directory / "_org.yml").write_text("version: 1\nallow:\n  - host: pypi.org\n")
    with pytest.raises(PolicyError, match=r"_org.yml:3:5: an allow entry needs 'ports'"):
        store.for_repository("octo/hello")


@pytest.mark.parametrize("name", ["../etc", "octo/../../etc/passwd", "octo/..", "octo", "/octo/hello",
                                  "octo/hello/x", "", "octo/", "-octo/hello", "octo/he llo", "octo\x00/hello"])
def test_names_that_could_escape_the_store_are_refused(store: PolicyStore, name: str):
    with pytest.raises(ValueError, match="is not a repository name"):
        store.for_repository(name)


def test_a_store_file_offers_its_repository_templates_and_a_bad_list_is_refused_at_its_line(tmp_path: Path):
    (tmp_path / "octo").mkdir()
    (tmp_path / "octo" / "node.yml").write_text("version: 1\ntemplates: [node20, go1.23]\n")
    (tmp_path / "octo" / "bad.yml").write_text("version: 1\ntemplates: [Node 20]\n")
    store = PolicyStore(tmp_path)
    assert store.templates_for("octo/node") == ("node20", "go1.23")
    assert store.templates_for("octo/none") == ()  # no store file: nothing beyond the service's own
    with pytest.raises(PolicyError, match=r"bad.yml:2:\d+: templates must be a list of template names"):
        store.templates_for("octo/bad")
