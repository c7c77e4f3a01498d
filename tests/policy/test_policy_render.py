"""Rendering: golden documents, the shape every ruleset must have, and the resolver's rule shape.

Regenerate the golden files after an intended change with `UPDATE_GOLDEN=1 pytest tests/policy`,
then read the diff before committing it.
"""

from __future__ import annotations

import os
import re
from ipaddress import ip_network
from pathlib import Path

import pytest

from policy import DENY_ALL, OperatorAllowances, RenderContext, Rule, dns_allow_rule, load_policy, render
from policy.render import port_groups

LIMIT = "-m limit --limit 100/second --limit-burst 200"  # every NFLOG rule is rate-limited

GOLDEN = Path(__file__).parent / "golden"

CONTEXT = RenderContext(
    guest_ip="172.16.0.2", guest_mac="52:54:00:AB:CD:EF", gateway_ip="172.16.0.1", dns_ip="172.16.0.1",
    host_addresses=("192.0.2.10", "2001:db8:ff::1"), guest_ip6="fd00:16::2", log_prefix="mvc:job-42",
)
OPERATOR = OperatorAllowances((
    Rule(frozenset({80}), network=ip_network("169.254.169.254/32")),
    Rule(frozenset({3128}), network=ip_network("172.16.0.1/32")),
))
BLOCK = load_policy("""\
version: 1
mode: block
allow:
  - host: pypi.org
    ports: [443]
  - host: "*.pythonhosted.org"
    ports: [443]
  - cidr: 10.20.0.0/16
    ports: [80, 443, 8000, 8001, 8002, 8003, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23]
  - cidr: 0.0.0.0/0
    ports: [53]
    protocol: udp
  - cidr: "2001:db8::/32"
    ports: [443]
""", "block.yml")
AUDIT = load_policy("version: 1\nmode: audit\nallow:\n  - cidr: 10.20.0.0/16\n    ports: [443]\n", "audit.yml")

CASES = {
    "block": (BLOCK, CONTEXT, OPERATOR),
    "audit": (AUDIT, CONTEXT, OperatorAllowances()),
    "deny_all": (DENY_ALL, RenderContext(guest_ip="10.0.0.2", guest_mac="52:54:00:00:00:01",
                                         gateway_ip="10.0.0.1", dns_ip="10.0.0.1"), OperatorAllowances()),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_golden(case: str, family: str):
    policy, context, allowances = CASES[case]
    document = getattr(render(policy, context, allowances), family)
    path = GOLDEN / f"{case}.{family}.rules"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(document)
    assert document == path.read_text(), f"{path} differs; regenerate with UPDATE_GOLDEN=1 if intended"


def forward(document: str) -> list[str]:
    return [line for line in document.splitlines() if line.startswith("-A FORWARD ")]


def test_block_forward_ends_in_reject_and_audit_in_accept_after_nflog():
    block = render(BLOCK, CONTEXT, OPERATOR)
    assert forward(block.ipv4)[-3:] == [
        f'-A FORWARD {LIMIT} -j NFLOG --nflog-group 100 --nflog-prefix "mvc:job-42"',
        "-A FORWARD -p tcp -j REJECT --reject-with tcp-reset",
        "-A FORWARD -j REJECT --reject-with icmp-admin-prohibited",
    ]
    assert forward(block.ipv6)[-1] == "-A FORWARD -j REJECT --reject-with icmp6-adm-prohibited"
    audit = render(AUDIT, CONTEXT)
    assert forward(audit.ipv4)[-2:] == [f'-A FORWARD {LIMIT} -j NFLOG --nflog-group 100 --nflog-prefix "mvc:job-42"',
                                        "-A FORWARD -j ACCEPT"]


def test_always_denied_destinations_come_before_every_policy_accept():
    lines = forward(render(BLOCK, CONTEXT, OPERATOR).ipv4)
    metadata_allowance = lines.index("-A FORWARD -d 169.254.169.254/32 -p tcp -m multiport --dports 80 -j ACCEPT")
    drops = [lines.index(f"-A FORWARD -d {net} -j MVC-DENIED") for net in
             ("169.254.0.0/16", "127.0.0.0/8", "224.0.0.0/4", "255.255.255.255/32", "192.0.2.10/32", "172.16.0.1/32")]
    first_policy_accept = lines.index("-A FORWARD -d 0.0.0.0/0 -p udp -m multiport --dports 53 -j ACCEPT")
    dns_jump = lines.index("-A FORWARD -j MVC-DNS-ALLOW")
    assert metadata_allowance < min(drops) and max(drops) < first_policy_accept < dns_jump


@pytest.mark.parametrize("policy", [BLOCK, AUDIT], ids=["block", "audit"])
def test_internal_ranges_are_refused_before_broad_rules_and_resolver_openings_in_every_mode(policy):
    """Audit mode ends in ACCEPT, so without these a guest reached the LAN by address; and a broad
    `cidr: 0.0.0.0/0` (meant for the internet) reached it in block mode. Only a rule inside the range
    (10.20.0.0/16 inside 10/8) comes before the refusals."""
    rendered = render(policy, CONTEXT)
    lines = forward(rendered.ipv4)
    refusals = [lines.index(f"-A FORWARD -d {net} -j MVC-INTERNAL")
                for net in ("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16")]
    opted_in = [i for i, line in enumerate(lines) if line.startswith("-A FORWARD -d 10.20.0.0/16 ")]
    broad = [i for i, line in enumerate(lines) if line.startswith("-A FORWARD -d 0.0.0.0/0 ")]
    assert opted_in and max(opted_in) < min(refusals)
    assert max(refusals) < min(broad + [lines.index("-A FORWARD -j MVC-DNS-ALLOW")])
    assert (broad != []) is (policy is BLOCK)
    chain = [line for line in rendered.ipv4.splitlines() if line.startswith("-A MVC-INTERNAL ")]
    assert chain == [f'-A MVC-INTERNAL {LIMIT} -j NFLOG --nflog-group 100 --nflog-prefix "mvc!internal-address"',
                     "-A MVC-INTERNAL -p tcp -j REJECT --reject-with tcp-reset",
                     "-A MVC-INTERNAL -j REJECT --reject-with icmp-admin-prohibited"]


def test_ipv6_refuses_ula_and_the_forms_carrying_a_private_ipv4_address():
    lines = forward(render(BLOCK, CONTEXT, OPERATOR).ipv6)
    for match in ("fc00::/7", "64:ff9b::a00:0/104", "2002:a00::/24", "2001::f500:0/ffff:ffff::ff00:0"):
        assert lines.index(f"-A FORWARD -d {match} -j MVC-INTERNAL") < lines.index("-A FORWARD -j MVC-DNS-ALLOW")


def test_always_denied_hits_are_logged_apart_from_the_policy_then_dropped():
    rendered = render(BLOCK, CONTEXT, OPERATOR)
    for document in (rendered.ipv4, rendered.ipv6):
        chain = [line for line in document.splitlines() if line.startswith("-A MVC-DENIED ")]
        assert chain == [f'-A MVC-DENIED {LIMIT} -j NFLOG --nflog-group 100 --nflog-prefix "mvc!always-denied"',
                         "-A MVC-DENIED -j DROP"]
    with pytest.raises(ValueError, match=r"^log_prefix 'mvc!always-denied' must be 1\.\.63 of "):  # no job's prefix can pass for it
        RenderContext(guest_ip="10.0.0.2", guest_mac="52:54:00:00:00:01", gateway_ip="10.0.0.1",
                      dns_ip="10.0.0.1", log_prefix="mvc!always-denied")


def test_input_admits_only_dns_and_operator_allowances_from_the_guest():
    lines = [line for line in render(BLOCK, CONTEXT, OPERATOR).ipv4.splitlines() if line.startswith("-A INPUT")]
    assert lines == [
        "-A INPUT -i tap0 ! -s 172.16.0.2/32 -j DROP",
        "-A INPUT -i tap0 -m mac ! --mac-source 52:54:00:ab:cd:ef -j DROP",
        "-A INPUT -i tap0 -d 172.16.0.1/32 -p udp -m udp --dport 53 -j ACCEPT",
        "-A INPUT -i tap0 -d 172.16.0.1/32 -p tcp -m tcp --dport 53 -j ACCEPT",
        "-A INPUT -i tap0 -d 169.254.169.254/32 -p tcp -m multiport --dports 80 -j ACCEPT",
        "-A INPUT -i tap0 -d 172.16.0.1/32 -p tcp -m multiport --dports 3128 -j ACCEPT",
        "-A INPUT -i tap0 -j DROP",
        "-A INPUT -i veth0 -j DROP",
    ]


def test_ipv6_is_dropped_without_a_guest_address_or_without_an_ipv6_rule():
    no_address = RenderContext(guest_ip="10.0.0.2", guest_mac="52:54:00:00:00:01", gateway_ip="10.0.0.1",
                               dns_ip="10.0.0.1")
    for policy, context in ((BLOCK, no_address), (AUDIT, CONTEXT)):
        document = render(policy, context).ipv6
        assert forward(document) == ["-A FORWARD -j DROP"]
        assert "ACCEPT" not in "".join(line for line in document.splitlines() if line.startswith("-A"))


def test_only_ipv6_rules_land_in_the_ipv6_document():
    document = render(BLOCK, CONTEXT, OPERATOR).ipv6
    assert "10.20.0.0" not in document and "169.254" not in document
    assert "-A FORWARD -d 2001:db8::/32 -p tcp -m multiport --dports 443 -j ACCEPT" in document
    assert "-A FORWARD -d 2001:db8:ff::1/128 -j MVC-DENIED" in document


def test_dns_allow_rule_shape():
    assert dns_allow_rule("151.101.0.223", {443}, "tcp") == (
        "-A MVC-DNS-ALLOW -d 151.101.0.223/32 -p tcp -m multiport --dports 443 -j ACCEPT")
    assert dns_allow_rule("2a04:4e42::223", [443, 80], "tcp") == (
        "-A MVC-DNS-ALLOW -d 2a04:4e42::223/128 -p tcp -m multiport --dports 80,443 -j ACCEPT")
    assert len(dns_allow_rule("10.0.0.1", range(1, 100, 2), "udp").splitlines()) == 4


NOT_AN_ADDRESS = "does not appear to be an IPv4 or IPv6 address"
BAD_PORTS = "a Rule needs integer ports in 1..65535, got "


@pytest.mark.parametrize("ip, ports, protocol, message", [
    ("1.2.3.4 -j ACCEPT", [443], "tcp", NOT_AN_ADDRESS), ("1.2.3.4/8", [443], "tcp", NOT_AN_ADDRESS),
    ("example.org", [443], "tcp", NOT_AN_ADDRESS), ("1.2.3.4", [], "tcp", BAD_PORTS + "[]"),
    ("1.2.3.4", [0], "tcp", BAD_PORTS + "[0]"), ("1.2.3.4", ["443"], "tcp", BAD_PORTS + "['443']"),
    ("1.2.3.4", [443, "80"], "tcp", BAD_PORTS + "['80', 443]"), ("1.2.3.4", [True], "tcp", BAD_PORTS + "[True]"),
    ("1.2.3.4", [443], "icmp", "protocol must be one of ('tcp', 'udp'), got 'icmp'"),
])
def test_dns_allow_rule_refuses_anything_but_an_address_ports_and_protocol(ip, ports, protocol, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        dns_allow_rule(ip, ports, protocol)


@pytest.mark.parametrize("ports, groups", [
    ([443], ["443"]),
    ([80, 81, 82, 443], ["80:82,443"]),
    (list(range(1, 31, 2)), ["1,3,5,7,9,11,13,15,17,19,21,23,25,27,29"]),
    (list(range(1, 33, 2)), ["1,3,5,7,9,11,13,15,17,19,21,23,25,27,29", "31"]),
    ([1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 16, 17, 19, 20, 22, 23], ["1:2,4:5,7:8,10:11,13:14,16:17,19:20", "22:23"]),
])
def test_port_groups_fit_multiport(ports, groups):
    assert port_groups(ports) == groups


PREFIX_CHARS = "must be 1..63 of A-Z a-z 0-9 _ . : = / -"


@pytest.mark.parametrize("field, value, message", [
    ("guest_ip", "fd00::2", "guest_ip fd00::2 must be an IPv4 address"),
    ("guest_ip", "not-an-ip", "'not-an-ip' " + NOT_AN_ADDRESS),
    ("gateway_ip", "1.2.3.4 -j ACCEPT", "'1.2.3.4 -j ACCEPT' " + NOT_AN_ADDRESS),
    ("guest_mac", "52:54:00:12:34", "guest_mac '52:54:00:12:34' is not a MAC like 52:54:00:12:34:56"),
    ("guest_mac", "52:54:00:12:34:56 -j ACCEPT", "is not a MAC like 52:54:00:12:34:56"),
    ("guest_iface", "tap0 -j ACCEPT", "guest_iface 'tap0 -j ACCEPT' is not an interface name"),
    ("uplink_iface", "a-very-long-interface", "uplink_iface 'a-very-long-interface' is not an interface name"),
    ("uplink_iface", "tap0", "guest_iface and uplink_iface must differ"),
    ("dns_port", 0, "dns_port 0 is out of range 1..65535"),
    ("log_prefix", 'x" -j ACCEPT', "log_prefix 'x\" -j ACCEPT' " + PREFIX_CHARS),
    ("log_prefix", "", "log_prefix '' " + PREFIX_CHARS),
    ("log_prefix", "x" * 64, f"log_prefix '{'x' * 64}' " + PREFIX_CHARS),
    ("nflog_group", 70000, "nflog_group 70000 is out of range 0..65535"),
    ("guest_ip6", "10.0.0.2", "guest_ip6 10.0.0.2 must be an IPv6 address"),
    ("host_addresses", ("nope",), "'nope' " + NOT_AN_ADDRESS),
])
def test_render_context_refuses_values_that_could_corrupt_the_document(field, value, message):
    fields = dict(guest_ip="10.0.0.2", guest_mac="52:54:00:00:00:01", gateway_ip="10.0.0.1", dns_ip="10.0.0.1")
    fields[field] = value
    with pytest.raises(ValueError, match=re.escape(message)):
        RenderContext(**fields)


def test_operator_allowances_are_networks_only():
    with pytest.raises(ValueError, match="must be a network"):
        OperatorAllowances((Rule(frozenset({443}), host="pypi.org"),))
