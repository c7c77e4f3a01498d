"""The `warm:` section of a repository's trusted file (policy.warm) and how the store reads it."""

from __future__ import annotations

import pytest

from policy import PolicyError, PolicyStore, load_policy, load_repository_file
from policy.model import DENY_ALL

WARM = """\
version: 1
allow: [{host: example.org, ports: [443]}]
warm:
  setup: python3 -m venv /opt/venv && /opt/venv/bin/pip install -r requirements.txt
  inputs: [requirements*.txt, wheels/*.whl]
  policy: {allow: [{host: pypi.org, ports: [443]}, {host: files.pythonhosted.org, ports: [443]}]}
"""


def _store(tmp_path, org: str | None, own: str | None) -> PolicyStore:
    if org is not None:
        (tmp_path / "_org.yml").write_text(org)
    if own is not None:
        (tmp_path / "acme").mkdir()
        (tmp_path / "acme" / "app.yml").write_text(own)
    return PolicyStore(tmp_path)


def test_a_store_file_with_warm_gives_its_setup_and_its_policy_within_the_org_default(tmp_path):
    store = _store(tmp_path, "version: 1\nallow: [{host: pypi.org, ports: [443]}]\n", WARM)
    spec, setup_policy = store.warm_for("acme/app")
    assert spec.inputs == ("requirements*.txt", "wheels/*.whl")
    assert spec.directories() == ("", "wheels")
    assert [rule.host for rule in setup_policy.rules] == ["pypi.org"]  # files.pythonhosted.org: not in the org's
    assert store.for_repository("acme/app").rules_for_host("example.org") == ()  # org allows only pypi


def test_the_store_file_wins_over_the_default_branch_and_the_branch_file_is_read_without_one(tmp_path):
    branch = load_repository_file(WARM.replace("requirements*.txt, ", ""), "acme/app:.github/microvm-check.yml")
    assert _store(tmp_path, None, None).warm_for("acme/app", lambda: branch)[0].inputs == ("wheels/*.whl",)
    store = _store(tmp_path, None, "version: 1\n")
    assert store.warm_for("acme/app", lambda: branch) is None  # the operator's file has no warm: none


def test_no_setup_policy_means_no_network_for_the_setup(tmp_path):
    store = _store(tmp_path, None, "version: 1\nwarm: {setup: make deps, inputs: [Makefile]}\n")
    assert store.warm_for("acme/app")[1] == DENY_ALL


def test_a_jobs_policy_cannot_have_warm(tmp_path):
    with pytest.raises(PolicyError, match=r"job policy:3:1: unknown key 'warm' in the policy"):
        _store(tmp_path, None, None).for_job("acme/app", WARM, None)
    with pytest.raises(PolicyError, match=r"unknown key 'warm'"):
        load_policy(WARM)


def test_the_org_default_cannot_have_warm(tmp_path):
    store = _store(tmp_path, WARM, None)
    with pytest.raises(PolicyError, match=r"_org.yml:3:1: unknown key 'warm'"):
        store.for_repository("acme/app")


@pytest.mark.parametrize("section, message", [
    ("warm: {inputs: [a.txt]}", r"app.yml:3:7: warm needs 'setup'"),
    ("warm: {setup: make}", r"app.yml:3:7: warm needs 'inputs'"),
    ("warm: {setup: make, inputs: ['*/req.txt']}", r"app.yml:3:30: warm.inputs: '\*/req.txt' has a wildcard in a directory"),
    ("warm: {setup: make, inputs: [../secrets]}", r"app.yml:3:30: warm.inputs: '../secrets' is not a path inside"),
    ("warm: {setup: make, inputs: [/etc/passwd]}", r"app.yml:3:30: warm.inputs: '/etc/passwd' is not a path inside"),
    ("warm: {setup: '', inputs: [a]}", r"app.yml:3:15: warm.setup: .* is not a command"),
    ("warm: {setup: make, inputs: [a], policy: {allow: [{host: 10.0.0.1, ports: [1]}]}}",
     r"app.yml:3:58: host: '10.0.0.1' is an IP address"),
    ("warm: {setup: make, inputs: [a], cache: yes}", r"app.yml:3:34: unknown key 'cache' in warm"),
    ("warm: [make]", r"app.yml:3:7: warm must be a mapping"),
])
def test_a_bad_warm_section_is_refused_with_file_line_and_column(tmp_path, section, message):
    store = _store(tmp_path, None, "version: 1\nallow: []\n" + section + "\n")
    with pytest.raises(PolicyError, match=message):
        store.warm_for("acme/app")
    with pytest.raises(PolicyError, match=message):  # the egress policy of that file does not load either
        store.for_repository("acme/app")
