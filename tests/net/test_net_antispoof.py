"""Anti-spoofing is two layers, and each one alone must stop a guest forging its source address.

The slot's raw-table guard (`MVC-GUARD`, policy/render.py `guard4`) and the policy's FORWARD rules
(policy/templates/_macros.j2) both drop packets from the tap whose source is not the guest's
address. With both in place, removing either one from the code fails no other test, so each test
here takes one layer out of the live namespace and checks that the other still drops a spoof. A
layer is taken out by inserting a rule ahead of it, never by deleting its rule: a test that deleted
the rule it expects would fail in its own set-up, not at its assertion, when the code lost that rule.

A spoof is told apart without a clock: the guest sends a forged datagram, then a genuine one on the
same path. The genuine one arrives (masqueraded to the slot's uplink address); had the forged one got
out, it would have arrived before it, with its forged source, since the path keeps their order.
"""

from __future__ import annotations

import socket
import subprocess

import pytest

from policy import load_policy
from runner.net import addresses, netns
from tests.net.net_fakes import ALLOWED_HOST, ip

SPOOFED = "10.9.9.9"
PORT = 8000
UDP_POLICY = f"version: 1\nmode: block\nallow:\n  - cidr: 203.0.113.0/24\n    ports: [{PORT}]\n    protocol: udp\n"
# What a bug in either layer would amount to: the raw guard skipped for everything from the tap
# (an ACCEPT in raw PREROUTING ends the table before its jump to MVC-GUARD), the FORWARD rules
# admitting the forged source ahead of their anti-spoof rule.
SKIP_GUARD = ("-t", "raw", "-I", "PREROUTING", "1", "-i", addresses.TAP_NAME, "-j", "ACCEPT")
ADMIT_IN_FORWARD = ("-t", "filter", "-I", "FORWARD", "1", "-s", f"{SPOOFED}/32", "-j", "ACCEPT")


def iptables(slot, *args: str) -> None:
    """Run the slot's own iptables backend (legacy or nft, as it loaded the rules) in its namespace."""
    binary = slot.firewall.restore4.replace("-restore", "")
    # -w: legacy iptables takes one host-wide lock (/run/xtables.lock), which another test's slot may hold
    done = subprocess.run(["ip", "netns", "exec", slot.netns, binary, "-w", *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def sources_seen(net, slot, guest: str) -> list[str]:
    """The source addresses at the fake internet of a forged datagram followed by a genuine one."""
    receiver = netns.socket_in(net.internet, socket.AF_INET, socket.SOCK_DGRAM)
    try:
        receiver.bind((ALLOWED_HOST, PORT))
        receiver.settimeout(30)  # the genuine datagram must come; a bound on a hang, not a timing

        def send() -> None:
            for source, payload in ((SPOOFED, b"forged"), (addresses.GUEST_IP, b"genuine")):
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                    sock.bind((source, 0))
                    sock.sendto(payload, (ALLOWED_HOST, PORT))

        netns.run_in(guest, send)
        seen: list[str] = []
        while True:
            payload, (source, _) = receiver.recvfrom(100)
            seen.append(source)
            if payload == b"genuine":
                return seen
    finally:
        receiver.close()


@pytest.fixture
def spoofing_guest(net, slot, guest) -> str:
    slot.apply_policy(load_policy(UDP_POLICY, "test-policy.yml"))
    ip("-n", guest, "addr", "add", f"{SPOOFED}/32", "dev", "eth0")
    return guest


def test_a_spoof_does_get_out_without_either_layer(net, slot, spoofing_guest) -> None:
    """Guards the two tests below: the topology would carry a forged source if nothing dropped it."""
    iptables(slot, *SKIP_GUARD)
    iptables(slot, *ADMIT_IN_FORWARD)
    assert sources_seen(net, slot, spoofing_guest) == [SPOOFED, addresses.veth_ip(slot.index)]


def test_the_raw_guard_alone_drops_a_spoofed_source(net, slot, spoofing_guest) -> None:
    iptables(slot, *ADMIT_IN_FORWARD)
    assert sources_seen(net, slot, spoofing_guest) == [addresses.veth_ip(slot.index)]


def test_the_forward_rules_alone_drop_a_spoofed_source(net, slot, spoofing_guest) -> None:
    iptables(slot, *SKIP_GUARD)
    assert sources_seen(net, slot, spoofing_guest) == [addresses.veth_ip(slot.index)]
