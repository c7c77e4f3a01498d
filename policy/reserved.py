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
from ipaddress import IPv4Address, ip_network

from policy.model import Address, Network


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
        if network.subnet_of(reserved.network):
            return reserved
    return None


# Addresses a DNS answer may not point a `host:` rule at (see `internal_range_containing`). A name
# is only as trustworthy as whoever controls its DNS today (a wildcard rule, a lapsed domain, a
# compromised zone), so an answer for one must not become a way into the network behind the runner
# host: its LAN, its VPC, its carrier's NAT, the slots' own uplink. A policy that means to reach such
# an address says so with a `cidr:` rule (which allows it by address anyway, with or without DNS).
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
# (`embedded_ipv4`): such an address is as internal as the IPv4 address it carries.
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
_IPV4_COMPATIBLE = ip_network("::/96")  # deprecated (RFC 4291), still routed to IPv4 by some stacks


def embedded_ipv4(address: Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 address hands traffic to: NAT64's well-known prefix, IPv4-compatible,
    6to4 (2002::/16) and a Teredo client (IPv4-mapped is always denied outright)."""
    if address.version != 6:
        return None
    if address in _NAT64_WELL_KNOWN or (address in _IPV4_COMPATIBLE and int(address) > 1):
        return IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    return address.teredo[1] if address.teredo is not None else None


def internal_range_containing(address: Address) -> ReservedRange | None:
    """The internal range `address` lies in (private, CGNAT, link-local, loopback, multicast,
    reserved, ULA, ...: `INTERNAL`), or the one of the IPv4 address it carries, or None for an
    address that may be public."""
    for reserved in INTERNAL:
        if address.version == reserved.network.version and address in reserved.network:
            return reserved
    carried = embedded_ipv4(address)
    return internal_range_containing(carried) if carried is not None else None
