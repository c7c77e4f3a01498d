"""Destinations no repository or job policy can open: only the operator's own config (`network.allow`) can.

These are the addresses through which a guest could reach the host or things that trust the host
(cloud metadata at 169.254.169.254, services on loopback, multicast neighbours). The renderer drops
them before any policy rule is consulted, so a broad rule such as `cidr: 0.0.0.0/0` is *clipped*
(it simply never matches them), and a DNS answer that points a permitted name at one of them (DNS
rebinding) is clipped the same way. The loader *rejects* a rule that lies entirely inside one of
them, because such a rule could never match anything and is almost certainly a mistake or a probe.
The host's own addresses and the VM's gateway are only known when rendering; they are clipped there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from ipaddress import IPv6Address, ip_address, ip_network

from policy.model import Address, Network, network_within


@dataclass(frozen=True)
class ReservedRange:
    network: Network
    what: str


ALWAYS_DENIED: tuple[ReservedRange, ...] = (
    ReservedRange(ip_network("0.0.0.0/8"), "'this network' (0.0.0.0/8)"),
    ReservedRange(ip_network("127.0.0.0/8"), "loopback"),
    ReservedRange(ip_network("169.254.0.0/16"), "link-local (incl. the metadata service 169.254.169.254)"),
    ReservedRange(ip_network("224.0.0.0/4"), "multicast"),
    ReservedRange(ip_network("255.255.255.255/32"), "broadcast"),
    ReservedRange(ip_network("::/128"), "the unspecified IPv6 address"),
    ReservedRange(ip_network("::1/128"), "IPv6 loopback"),
    ReservedRange(ip_network("::ffff:0:0/96"), "IPv4-mapped IPv6 (it would bypass the IPv4 rules)"),
    ReservedRange(ip_network("fe80::/10"), "IPv6 link-local"),
    ReservedRange(ip_network("ff00::/8"), "IPv6 multicast"),
)


def always_denied(version: int) -> tuple[ReservedRange, ...]:
    return tuple(reserved for reserved in ALWAYS_DENIED if reserved.network.version == version)


def reserved_containing(network: Network) -> ReservedRange | None:
    """The always-denied range that wholly contains `network`, if any."""
    for reserved in always_denied(network.version):
        if network_within(network, reserved.network):
            return reserved
    return None


# Addresses a DNS answer may not point a `host:` rule at, and a guest may not reach directly, in
# `block` and `audit` mode alike (see `internal_range_containing`, `opted_in`). A name is only as
# trustworthy as whoever controls its DNS today (a wildcard rule, a lapsed domain, a compromised
# zone), and a fork's code is not trustworthy at all, so neither may become a way into the network
# behind the runner host: its LAN, its VPC, its carrier's NAT, the slots' own uplink. A policy that
# means to reach such an address says so with a `cidr:` rule inside the range (`opted_in`).
#
# The list is IANA's special-purpose registries (RFC 6890 and successors) minus what is routed on
# the internet, and minus the three documentation networks (TEST-NET-1/2/3: 192.0.2.0/24,
# 198.51.100.0/24, 203.0.113.0/24): they are never routed and, by convention, never numbered on
# a LAN, so no internal host can be reached through them, and the tests' fake internet lives there.
# Judged for a real runner host: no public name can legitimately resolve into TEST-NET, so refusing
# it would cost honest jobs nothing; it stays open only for the tests (tests/net, tests/vm and
# tests/service all serve their fake internet from it). The risk it leaves is a LAN numbered in it
# by mistake (copied from documentation), which is the same risk as a LAN numbered in public space
# the organisation does not own (1.1.1.0/24 is the classic), and that no fixed list can catch: this
# list protects LANs numbered by the RFCs only. A host whose internal networks are numbered
# otherwise needs them refused by the operator's own configuration (not available yet).
# Guests get no AAAA answers at all; the IPv6 part keeps the check complete for when they do,
# including the IPv6 forms that carry an IPv4 address a translator or relay would deliver to
# (`internal_ranges`): such an address is as internal as the IPv4 address it carries.
INTERNAL: tuple[ReservedRange, ...] = (
    *ALWAYS_DENIED,
    ReservedRange(ip_network("10.0.0.0/8"), "private (RFC 1918)"),
    ReservedRange(ip_network("100.64.0.0/10"), "carrier-grade NAT (RFC 6598)"),
    ReservedRange(ip_network("172.16.0.0/12"), "private (RFC 1918)"),
    ReservedRange(ip_network("192.0.0.0/24"), "IETF protocol assignments (RFC 6890)"),
    ReservedRange(ip_network("192.168.0.0/16"), "private (RFC 1918)"),
    ReservedRange(ip_network("198.18.0.0/15"), "benchmarking (RFC 2544; the slots' uplinks)"),
    ReservedRange(ip_network("240.0.0.0/4"), "reserved (RFC 1112)"),
    ReservedRange(ip_network("64:ff9b:1::/48"), "local-use NAT64 (RFC 8215)"),
    ReservedRange(ip_network("100::/64"), "IPv6 discard-only (RFC 6666)"),
    ReservedRange(ip_network("fc00::/7"), "IPv6 unique local (ULA, RFC 4193)"),
    ReservedRange(ip_network("fec0::/10"), "IPv6 site-local (deprecated, RFC 3879)"),
)


_NAT64_WELL_KNOWN = ip_network("64:ff9b::/96")  # RFC 6052: the IPv4 address is the last 32 bits


@dataclass(frozen=True)
class InternalRange:
    """One internal range as the rendered rules match it (`iptables -d match`) and the resolver
    checks it: an address and a mask, which for Teredo is not a prefix (the client's IPv4 address
    sits in the last 32 bits, after the server's), so not an `ip_network`.

    `always_denied`: an `ALWAYS_DENIED` range itself, which the renderer drops earlier and nothing
    but the operator opens. `policy_may_open`: whether a repository's `cidr:` rule lying inside it
    opts into it (see `opted_in`); never for an always-denied range or an IPv6 form carrying one.
    """

    version: int
    address: int
    mask: int
    what: str
    always_denied: bool = False
    policy_may_open: bool = True

    @property
    def match(self) -> str:
        """`10.0.0.0/8`, or `2001::f500:0/ffff:ffff::ff00:0` where the mask is no prefix."""
        address = ip_address(self.address) if self.version == 4 else IPv6Address(self.address)
        bits = 32 if self.version == 4 else 128
        prefix = bin(self.mask).count("1")
        if self.mask == ((1 << bits) - 1) ^ ((1 << (bits - prefix)) - 1):
            return f"{address}/{prefix}"
        return f"{address}/{IPv6Address(self.mask)}"

    def contains(self, address: Address) -> bool:
        return address.version == self.version and int(address) & self.mask == self.address

    def holds(self, network: Network) -> bool:
        """Whether all of `network` lies inside this range."""
        return (network.version == self.version and self.mask & ~int(network.netmask) == 0
                and int(network.network_address) & self.mask == self.address)


def _from_network(network: Network, what: str, **flags: bool) -> InternalRange:
    return InternalRange(network.version, int(network.network_address), int(network.netmask), what, **flags)


def _carriers(reserved: ReservedRange) -> list[InternalRange]:
    """The IPv6 forms a translator or relay delivers to an address of the IPv4 range `reserved`:
    NAT64's well-known prefix, IPv4-compatible (::a.b.c.d, deprecated, still routed to IPv4 by some
    stacks), 6to4 (2002:AABB:CCDD::/48) and a Teredo client (the last 32 bits, inverted).
    IPv4-mapped IPv6 is always denied outright."""
    v4 = reserved.network
    low, mask = int(v4.network_address), int(v4.netmask)
    may_open = reserved not in ALWAYS_DENIED
    forms = [
        (int(_NAT64_WELL_KNOWN.network_address) | low, ((1 << 96) - 1) << 32 | mask, "NAT64 (RFC 6052)"),
        (low, ((1 << 96) - 1) << 32 | mask, "IPv4-compatible IPv6"),
        ((0x2002 << 112) | (low << 80), ((1 << 16) - 1) << 112 | (mask << 80), "6to4 (RFC 3056)"),
        ((0x20010000 << 96) | (~low & mask), ((1 << 32) - 1) << 96 | mask, "Teredo (RFC 4380)"),
    ]
    return [InternalRange(6, address, form_mask, f"{reserved.what} in {kind}", policy_may_open=may_open)
            for address, form_mask, kind in forms]


@cache
def internal_ranges(version: int) -> tuple[InternalRange, ...]:
    """Every internal range of an IP version as the rules match it: `INTERNAL`, and for IPv6 also
    the forms carrying an internal IPv4 address. The one list the renderer refuses and the resolver
    checks, so an address is internal to both or to neither."""
    ranges = [_from_network(reserved.network, reserved.what, always_denied=reserved in ALWAYS_DENIED,
                            policy_may_open=reserved not in ALWAYS_DENIED)
              for reserved in INTERNAL if reserved.network.version == version]
    if version == 6:
        ranges += [form for reserved in INTERNAL if reserved.network.version == 4 for form in _carriers(reserved)]
    return tuple(ranges)


def internal_range_containing(address: Address) -> InternalRange | None:
    """The internal range `address` lies in (private, CGNAT, link-local, loopback, multicast,
    reserved, ULA, ..., or an IPv6 form carrying such an IPv4 address), or None for an address
    that may be public. Always-denied ranges come first."""
    return next((internal for internal in internal_ranges(address.version) if internal.contains(address)), None)


def opted_in(network: Network) -> bool:
    """Whether a repository's `cidr:` rule for `network` opts into the internal range it lies in.

    Only a rule at least as specific as an internal range, i.e. wholly inside one that a policy may
    open (`10.20.0.0/16` inside 10/8), reaches addresses of it: a broad rule (`0.0.0.0/0`, `8.0.0.0/6`)
    overlapping a LAN range is meant for the internet and is clipped there, for direct traffic and
    resolver answers alike. A rule inside a range no policy may open (nested in one it may: the
    Teredo form of 255.255.255.255 inside that of 240/4) opts into nothing.
    """
    holding = [internal for internal in internal_ranges(network.version) if internal.holds(network)]
    return bool(holding) and all(internal.policy_may_open for internal in holding)
