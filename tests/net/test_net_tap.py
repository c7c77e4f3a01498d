"""The real tap, driven as QEMU drives it: Ethernet frames written to and read from /dev/net/tun.

The other tests use a veth stand-in for the guest (a real TCP/IP stack is handier); this one checks
the device QEMU actually attaches to: a DNS query from the guest's MAC and IP is answered, the same
query from another MAC or another source address is not.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
from collections.abc import Iterator

import pytest
from dnslib import DNSRecord
from pyroute2 import IPRoute

from policy import load_policy
from runner.net import Slot, addresses, netns
from tests.net.net_fakes import ALLOWED_HOST, ip

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
REPLY_WAIT_SECONDS = 2.0


def mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def checksum(header: bytes) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    total = (total & 0xFFFF) + (total >> 16)
    return ~((total & 0xFFFF) + (total >> 16)) & 0xFFFF


def dns_frame(dst_mac: bytes, src_mac: str, src_ip: str, query: bytes) -> bytes:
    udp = struct.pack("!HHHH", 40000, addresses.DNS_PORT, 8 + len(query), 0) + query
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0,
                         socket.inet_aton(src_ip), socket.inet_aton(addresses.DNS_IP))
    header = header[:10] + struct.pack("!H", checksum(header)) + header[12:]
    return dst_mac + mac_bytes(src_mac) + b"\x08\x00" + header + udp


@pytest.fixture
def tap(slot: Slot) -> Iterator[int]:
    """The slot's tap opened like QEMU opens it, inside the slot's namespace."""
    fd = netns.run_in(slot.netns, lambda: os.open("/dev/net/tun", os.O_RDWR))
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", addresses.TAP_NAME.encode(), IFF_TAP | IFF_NO_PI))
        yield fd
    finally:
        os.close(fd)


def tap_mac(slot: Slot) -> bytes:
    def read() -> str:
        with IPRoute() as ipr:
            return str(ipr.get_links(ipr.link_lookup(ifname=addresses.TAP_NAME)[0])[0].get("IFLA_ADDRESS"))

    return mac_bytes(netns.run_in(slot.netns, read))


def dns_reply(fd: int, query_id: int) -> DNSRecord | None:
    """The resolver's answer to `query_id` as it comes out of the tap, or None if none comes."""
    while select.select([fd], [], [], REPLY_WAIT_SECONDS)[0]:
        frame = os.read(fd, 65536)
        if frame[12:14] != b"\x08\x00" or frame[14 + 9] != 17:
            continue  # not IPv4/UDP (IPv6 neighbour discovery, ARP, ...)
        ihl = (frame[14] & 0x0F) * 4
        sport = struct.unpack("!H", frame[14 + ihl : 16 + ihl])[0]
        reply = DNSRecord.parse(frame[14 + ihl + 8 :])
        if sport == addresses.DNS_PORT and reply.header.id == query_id:
            return reply
    return None


def ask(fd: int, slot: Slot, src_mac: str, src_ip: str, query_id: int, name: str = "web.test") -> DNSRecord | None:
    query = DNSRecord.question(name)
    query.header.id = query_id
    os.write(fd, dns_frame(tap_mac(slot), src_mac, src_ip, query.pack()))
    return dns_reply(fd, query_id)


def test_the_tap_carries_the_guests_dns_and_drops_spoofs(slot, tap) -> None:
    slot.apply_policy(load_policy("version: 1\nallow:\n  - host: web.test\n    ports: [8000]\n", "tap.yml"))
    # The guest would answer the slot's ARP request; this test plays no ARP, so it says it up front.
    ip("-n", slot.netns, "neigh", "replace", addresses.GUEST_IP, "lladdr", addresses.GUEST_MAC, "dev", addresses.TAP_NAME)
    assert slot.resolver is not None

    answer = ask(tap, slot, addresses.GUEST_MAC, addresses.GUEST_IP, 1)
    assert answer is not None and [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]

    # Spoofed queries ask a refused name: had the resolver seen one, it would have counted it.
    assert ask(tap, slot, "52:54:00:00:00:99", addresses.GUEST_IP, 2, "spoofed-mac.test") is None
    assert ask(tap, slot, addresses.GUEST_MAC, "10.9.9.9", 3, "spoofed-ip.test") is None
    assert dict(slot.resolver.refused) == {}
    assert ask(tap, slot, addresses.GUEST_MAC, addresses.GUEST_IP, 4, "refused.test") is not None
    assert dict(slot.resolver.refused) == {"refused.test": 1}
