"""The internal ranges as the rendered rules and the resolver both see them, and which `cidr:` rules
opt into them (only one lying inside the range: never `0.0.0.0/0`)."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy.reserved import INTERNAL, internal_range_containing, internal_ranges, opted_in


def carried_ipv4(address: IPv6Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 one delivers to, by the standard library's reading of each form: the
    oracle the hand-built masks of `internal_ranges` are checked against."""
    if address in ip_network("64:ff9b::/96") or address in ip_network("::/96"):
        return IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    return address.teredo[1] if address.teredo is not None else None


def internal_by_oracle(address: IPv4Address | IPv6Address) -> bool:
    if any(address.version == reserved.network.version and address in reserved.network for reserved in INTERNAL):
        return True
    carried = carried_ipv4(address) if address.version == 6 else None
    return carried is not None and internal_by_oracle(carried)


def near_internal_ipv6() -> st.SearchStrategy[IPv6Address]:
    """IPv6 addresses in the carrier forms (random addresses almost never land in them), around the
    internal IPv4 ranges' edges as often as inside."""
    ipv4 = st.one_of(st.integers(0, 2**32 - 1),
                     st.sampled_from([int(r.network.network_address) + d for r in INTERNAL if r.network.version == 4
                                      for d in (-1, 0, 1)]).map(lambda n: n % 2**32))
    middle = st.integers(0, 2**64 - 1)
    return st.one_of(
        ipv4.map(lambda v4: IPv6Address((0x64FF9B << 96) | v4)),
        ipv4.map(lambda v4: IPv6Address(v4)),
        st.tuples(ipv4, st.integers(0, 2**80 - 1)).map(lambda t: IPv6Address((0x2002 << 112) | (t[0] << 80) | t[1])),
        st.tuples(ipv4, middle).map(lambda t: IPv6Address((0x20010000 << 96) | (t[1] << 32) | (~t[0] & 0xFFFFFFFF))),
        st.integers(0, 2**128 - 1).map(IPv6Address),
    )


@given(st.one_of(st.integers(0, 2**32 - 1).map(IPv4Address), near_internal_ipv6()))
def test_the_firewall_ranges_hold_exactly_the_internal_addresses(address) -> None:
    assert (internal_range_containing(address) is not None) is internal_by_oracle(address)


@pytest.mark.parametrize("address, match", [
    ("10.0.0.5", "10.0.0.0/8"), ("64:ff9b::10.0.0.5", "64:ff9b::a00:0/104"), ("::10.0.0.5", "::a00:0/104"),
    ("2002:a00:5::1", "2002:a00::/24"),
    ("2001:0:4136:e378:8000:63bf:f5ff:fffa", "2001::f500:0/ffff:ffff::ff00:0"),  # Teredo: no prefix, a mask
])
def test_each_range_renders_as_an_iptables_match(address: str, match: str) -> None:
    found = internal_range_containing(ip_address(address))
    assert found is not None and found.match == match


@pytest.mark.parametrize("network, opts_in", [
    ("0.0.0.0/0", False), ("::/0", False), ("8.0.0.0/6", False), ("10.0.0.0/7", False),  # wider than 10/8
    ("203.0.113.0/24", False),  # public (TEST-NET): nothing to opt into
    ("10.0.0.0/8", True), ("10.20.0.0/16", True), ("10.0.0.5/32", True), ("100.64.0.0/10", True),
    ("172.16.0.0/12", True), ("172.0.0.0/11", False), ("fd00::/8", True), ("fc00::/6", False),
    ("64:ff9b::a00:0/104", True),  # NAT64 to 10/8, the same decision as for 10/8 itself
    ("169.254.169.254/32", False), ("64:ff9b::a9fe:a9fe/128", False),  # always denied, also through NAT64
])
def test_only_a_rule_inside_an_internal_range_opts_into_it(network: str, opts_in: bool) -> None:
    assert opted_in(ip_network(network)) is opts_in


def test_ipv6_covers_the_carried_forms_of_every_internal_ipv4_range() -> None:
    ipv4 = [reserved for reserved in INTERNAL if reserved.network.version == 4]
    native = [reserved for reserved in INTERNAL if reserved.network.version == 6]
    assert len(internal_ranges(6)) == len(native) + 4 * len(ipv4)
    assert all(internal.version == 4 for internal in internal_ranges(4))
