"""Intersection of policies: a job policy can narrow the repository's egress, never widen it."""

from __future__ import annotations

from ipaddress import ip_network

import pytest

from policy import DENY_ALL, Policy, Rule, intersect, load_policy
from policy.compose import intersect_hosts, intersect_networks

REPO = load_policy("""\
version: 1
mode: block
allow:
  - host: pypi.org
    ports: [443]
  - host: "*.pythonhosted.org"
    ports: [443]
  - cidr: 10.20.0.0/16
    ports: [80, 443]
""", "repo.yml")


def job(allow: str, mode: str = "block") -> Policy:
    return load_policy(f"version: 1\nmode: {mode}\nallow:\n{allow}", "job policy")


def test_job_cannot_add_a_host():
    effective = intersect(REPO, job("  - host: evil.example\n    ports: [443]\n"))
    assert effective.rules == ()
    assert not effective.allows(443, "tcp", name="evil.example")


def test_job_cannot_add_a_port():
    effective = intersect(REPO, job("  - host: pypi.org\n    ports: [22, 443]\n"))
    assert effective.rules == (Rule(frozenset({443}), host="pypi.org"),)


def test_job_cannot_widen_a_network():
    effective = intersect(REPO, job("  - cidr: 10.0.0.0/8\n    ports: [443]\n"))
    assert effective.rules == (Rule(frozenset({443}), network=ip_network("10.20.0.0/16")),)
    assert not effective.allows(443, "tcp", address="10.21.0.1")


def test_job_cannot_switch_a_block_policy_to_audit():
    effective = intersect(REPO, job("  - host: pypi.org\n    ports: [443]\n", mode="audit"))
    assert effective.mode == "block"


def test_job_cannot_change_the_protocol():
    assert intersect(REPO, job("  - host: pypi.org\n    ports: [443]\n    protocol: udp\n")).rules == ()


def test_job_can_narrow_everything():
    effective = intersect(REPO, job(
        "  - host: files.pythonhosted.org\n    ports: [443]\n"
        "  - cidr: 10.20.30.0/24\n    ports: [80]\n"))
    assert effective == Policy(rules=(
        Rule(frozenset({443}), host="files.pythonhosted.org"),
        Rule(frozenset({80}), network=ip_network("10.20.30.0/24")),
    ))


def test_both_audit_stays_audit_and_order_does_not_matter():
    a = job("  - host: pypi.org\n    ports: [443]\n", mode="audit")
    b = job("  - host: '*.pypi.org'\n    ports: [443]\n", mode="audit")
    assert intersect(a, a).mode == "audit"
    assert intersect(a, b) == intersect(b, a)
    assert intersect(REPO, a).mode == intersect(a, REPO).mode == "block"


def test_intersection_with_deny_all_is_deny_all():
    assert intersect(REPO, DENY_ALL) == DENY_ALL
    assert intersect(DENY_ALL, REPO) == DENY_ALL


def test_intersection_of_three_layers():
    org = job("  - cidr: 10.0.0.0/8\n    ports: [80, 443]\n  - host: '*.pypi.org'\n    ports: [443]\n")
    narrowed = intersect(org, job("  - cidr: 10.20.0.0/16\n    ports: [80, 443, 8080]\n"),
                         job("  - cidr: 10.20.1.0/24\n    ports: [443]\n"))
    assert narrowed.rules == (Rule(frozenset({443}), network=ip_network("10.20.1.0/24")),)


@pytest.mark.parametrize("a, b, expected", [
    ("pypi.org", "pypi.org", "pypi.org"),
    ("pypi.org", "files.pypi.org", None),
    ("files.pythonhosted.org", "*.pythonhosted.org", "files.pythonhosted.org"),
    ("*.pythonhosted.org", "a.b.pythonhosted.org", "a.b.pythonhosted.org"),
    ("pythonhosted.org", "*.pythonhosted.org", None),  # a wildcard never admits its own base
    ("*.a.example.org", "*.example.org", "*.a.example.org"),
    ("*.example.org", "*.a.example.org", "*.a.example.org"),
    ("*.a.example.org", "*.b.example.org", None),
    ("*.example.org", "*.xexample.org", None),
    ("notexample.org", "*.example.org", None),
])
def test_host_intersection(a: str, b: str, expected: str | None):
    assert intersect_hosts(a, b) == expected
    assert intersect_hosts(b, a) == expected


@pytest.mark.parametrize("a, b, expected", [
    ("10.0.0.0/8", "10.20.0.0/16", "10.20.0.0/16"),
    ("10.20.0.0/16", "10.0.0.0/8", "10.20.0.0/16"),
    ("10.0.0.0/16", "10.1.0.0/16", None),
    ("0.0.0.0/0", "192.0.2.7/32", "192.0.2.7/32"),
    ("10.0.0.0/8", "2001:db8::/32", None),
    ("2001:db8::/32", "2001:db8:1::/48", "2001:db8:1::/48"),
])
def test_network_intersection(a: str, b: str, expected: str | None):
    result = intersect_networks(ip_network(a), ip_network(b))
    assert (str(result) if result else None) == expected


def test_a_host_rule_and_a_network_rule_share_nothing():
    """Documented choice: "name matches and address in network" is not one rule, so it is dropped."""
    hosts = job("  - host: pypi.org\n    ports: [443]\n")
    networks = job("  - cidr: 0.0.0.0/0\n    ports: [443]\n")
    assert intersect(hosts, networks).rules == ()
