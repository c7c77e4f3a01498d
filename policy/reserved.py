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
from ipaddress import ip_network

from policy.model import Network


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
