"""The fixed addressing every guest sees, and the per-slot uplink addresses.

The snapshot template bakes the guest side (MAC, IP, gateway, resolver) into the guest, so every VM
looks identical on the inside and a snapshot restores without reconfiguration. Changing any guest
constant here means re-baking every template: tell the template owner first.
"""

from __future__ import annotations

import ipaddress

GUEST_MAC = "52:54:00:00:00:02"
GUEST_IP = "192.0.2.2"
GUEST_PREFIXLEN = 30
GATEWAY_IP = "192.0.2.1"
DNS_IP = GATEWAY_IP
DNS_PORT = 53

TAP_NAME = "tap0"
VETH_NAME = "veth0"

# Each slot's veth pair gets its own /30 out of this /15 (RFC 2544 benchmarking space, never routed
# on the internet): slot i owns 198.18.0.0 + 4*i, the uplink end is .1 and the namespace end .2.
UPLINK_POOL = ipaddress.IPv4Network("198.18.0.0/15")
UPLINK_PREFIXLEN = 30
MAX_SLOTS = UPLINK_POOL.num_addresses // 4

# The name check (runner.net.nameproxy) listens on the gateway at this port inside each slot; the
# guest never reaches it directly (the raw guard drops frames to the namespace's own addresses), only
# through the nat table's REDIRECT of connections under a name-checked rule. Its upstream sockets
# carry NAMECHECK_MARK (SO_MARK needs CAP_NET_ADMIN: only the host's own processes can set it), the
# one thing the guard lets the namespace originate towards the uplink, and replies of those
# connections (connmark) the one thing from the uplink it lets reach a socket of the namespace.
NAMECHECK_PORT = 15001
NAMECHECK_MARK = 0x6D7663

# NFLOG group the audit-mode rules log to. NFLOG groups are per network namespace, so one number
# serves every slot; the policy renderer must log would-be-blocked packets to this group.
AUDIT_NFLOG_GROUP = 100


def slot_network(index: int) -> ipaddress.IPv4Network:
    """The /30 of slot `index`'s veth pair."""
    if not 0 <= index < MAX_SLOTS:
        raise ValueError(f"slot index {index} is outside 0..{MAX_SLOTS - 1}")
    base = int(UPLINK_POOL.network_address) + 4 * index
    return ipaddress.IPv4Network((base, UPLINK_PREFIXLEN))


def uplink_ip(index: int) -> str:
    """The uplink end of slot `index` (the namespace's default gateway)."""
    return str(slot_network(index).network_address + 1)


def veth_ip(index: int) -> str:
    """The namespace end of slot `index`: the source address of its guest's traffic after NAT."""
    return str(slot_network(index).network_address + 2)
