"""The slot's own tables and the host's chains, written by policy/render.py (the one writer of iptables
text) and pinned by golden files: the raw/mangle guards, the nat table with the name check's redirects,
and the uplink's host rules. The goldens were taken from the code before it moved out of
runner/net/firewall.py and runner/net/uplink.py; regenerate with `UPDATE_GOLDEN=1 pytest tests/policy`
only after an intended change."""

from __future__ import annotations

import os
from ipaddress import ip_network
from pathlib import Path

import pytest

from policy.blocklist import BlockList
from policy.model import Rule
from policy.render import (
    HostChains,
    OperatorAllowances,
    RenderContext,
    guard4,
    guard6,
    masquerade,
    namecheck_lines,
    uplink_rules,
)

GOLDEN = Path(__file__).parent / "golden"
SLOT = RenderContext(guest_ip="192.0.2.2", guest_mac="52:54:00:00:00:02", gateway_ip="192.0.2.1", dns_ip="192.0.2.1",
                     namecheck_port=15001, namecheck_mark=0x6D7663)
UPLINK_POOL = ip_network("198.18.0.0/15")
ALLOWANCES = OperatorAllowances((Rule(frozenset({3128, 8080, 8081}), "tcp", network=ip_network("10.9.9.0/24")),
                                 Rule(frozenset({53}), "udp", network=ip_network("fd00::/64"))))
BLOCKED = BlockList(networks=(ip_network("203.0.113.0/24"), ip_network("2001:db8:1::/48")))


def _tcp(ports: set[int], network: str) -> Rule:
    return Rule(frozenset(ports), "tcp", network=ip_network(network))


def _nat() -> str:
    address_rules = [_tcp({22}, "8.8.8.0/24"), Rule(frozenset({53}), "udp", network=ip_network("8.8.4.4/32"))]
    raw = [_tcp({443, 80}, "151.101.0.1/32")]
    checked = [_tcp({443}, "151.101.0.1/32"), _tcp({443}, "1.2.3.4/32")]
    return masquerade(SLOT, namecheck_lines(SLOT, address_rules, raw, checked, ["5.6.7.8"]))


def _uplink() -> str:
    chains = HostChains(into_host="MVC-MVC-IN", through="MVC-MVC-FWD", nat="MVC-MVC-NAT")
    return "".join(f"{table} {line}\n" for table, line in uplink_rules(chains, "mvc-+", "eth9", UPLINK_POOL, ALLOWANCES))


DOCUMENTS = {
    "slot.guard4.rules": lambda: guard4(SLOT, UPLINK_POOL, ALLOWANCES, BLOCKED),
    "slot.guard6.rules": lambda: guard6(SLOT, ALLOWANCES, BLOCKED),
    "slot.nat.rules": _nat,
    "uplink.rules": _uplink,
}


@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_golden(name: str) -> None:
    document, path = DOCUMENTS[name](), GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(document)
    assert document == path.read_text(), f"{path} differs; regenerate with UPDATE_GOLDEN=1 if intended"


def test_a_raw_opening_gives_way_to_a_checked_one_at_the_same_address() -> None:
    lines = namecheck_lines(SLOT, [], [_tcp({443, 80}, "151.101.0.1/32")], [_tcp({443}, "151.101.0.1/32")])
    assert lines == ["-A MVC-NAMECHECK -d 151.101.0.1/32 -p tcp -m multiport --dports 80 -j RETURN",
                     "-A MVC-NAMECHECK -d 151.101.0.1/32 -p tcp -m multiport --dports 443 "
                     "-j REDIRECT --to-ports 15001"]
