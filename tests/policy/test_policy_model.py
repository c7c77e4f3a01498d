"""The policy model: normalisation, matching and the digest recorded in job records."""

from __future__ import annotations

import re
from ipaddress import ip_network

import pytest

from policy import DENY_ALL, Policy, Rule, load_policy
from policy.model import host_matches


def test_equal_meaning_gives_equal_policies_and_digests():
    split = load_policy("version: 1\nallow:\n"
                        "  - cidr: 10.0.0.0/8\n    ports: [443]\n"
                        "  - host: pypi.org\n    ports: [80]\n"
                        "  - host: pypi.org\n    ports: [443, 80]\n")
    merged = load_policy("version: 1\nmode: block\nallow:\n"
                         "  - {host: PYPI.org, ports: [443, 80]}\n"
                         "  - {cidr: 10.0.0.0/8, ports: [443], protocol: tcp}\n")
    assert split == merged
    assert split.digest() == merged.digest()


def test_digest_is_stable_and_distinguishes_meaning():
    policy = Policy(rules=(Rule(frozenset({443}), host="pypi.org"),))
    assert policy.digest() == (
        "sha256:" + __import__("hashlib").sha256(
            b'{"allow":[{"host":"pypi.org","ports":[443],"protocol":"tcp"}],"mode":"block","version":1}'
        ).hexdigest())
    assert Policy(mode="audit", rules=policy.rules).digest() != policy.digest()
    assert Policy(rules=(Rule(frozenset({443}), "udp", host="pypi.org"),)).digest() != policy.digest()
    assert DENY_ALL.digest() != policy.digest()


@pytest.mark.parametrize("pattern, name, expected", [
    ("pypi.org", "pypi.org", True),
    ("pypi.org", "PyPI.org.", True),
    ("pypi.org", "www.pypi.org", False),
    ("*.pythonhosted.org", "files.pythonhosted.org", True),
    ("*.pythonhosted.org", "a.b.pythonhosted.org", True),
    ("*.pythonhosted.org", "pythonhosted.org", False),
    ("*.pythonhosted.org", "evilpythonhosted.org", False),
])
def test_host_matching(pattern: str, name: str, expected: bool):
    assert host_matches(pattern, name) is expected


def test_rules_for_host_is_what_the_resolver_asks():
    policy = load_policy("version: 1\nallow:\n"
                         "  - {host: '*.pythonhosted.org', ports: [443]}\n"
                         "  - {host: files.pythonhosted.org, ports: [80]}\n"
                         "  - {cidr: 10.0.0.0/8, ports: [53], protocol: udp}\n")
    assert {rule.host for rule in policy.rules_for_host("files.pythonhosted.org")} == {
        "*.pythonhosted.org", "files.pythonhosted.org"}
    assert policy.rules_for_host("pypi.org") == ()


def test_allows_looks_at_names_for_host_rules_and_addresses_for_networks():
    policy = Policy(rules=(Rule(frozenset({443}), host="pypi.org"),
                           Rule(frozenset({53}), "udp", network=ip_network("2001:db8::/32"))))
    assert policy.allows(443, "tcp", name="pypi.org")
    assert not policy.allows(443, "tcp", address="151.101.0.223")
    assert policy.allows(53, "udp", address="2001:db8::1")
    assert not policy.allows(53, "tcp", address="2001:db8::1")
    assert not policy.allows(53, "udp", address="10.0.0.1")


@pytest.mark.parametrize("kwargs, message", [
    ({"ports": frozenset({443})}, "a Rule needs exactly one of host or network"),
    ({"ports": frozenset({443}), "host": "a.example", "network": ip_network("10.0.0.0/8")},
     "a Rule needs exactly one of host or network"),
    ({"ports": frozenset(), "host": "a.example"}, "a Rule needs integer ports in 1..65535, got []"),
    ({"ports": frozenset({0}), "host": "a.example"}, "a Rule needs integer ports in 1..65535, got [0]"),
    ({"ports": frozenset({443, "80"}), "host": "a.example"}, "a Rule needs integer ports in 1..65535, got ['80', 443]"),
    ({"ports": frozenset({1}), "host": "a.example", "protocol": "icmp"}, "protocol must be one of ('tcp', 'udp'), got 'icmp'"),
])
def test_rule_refuses_impossible_values(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Rule(**kwargs)


def test_policy_refuses_unknown_mode():
    with pytest.raises(ValueError, match=re.escape("mode must be one of ('block', 'audit'), got 'loud'")):
        Policy(mode="loud")
