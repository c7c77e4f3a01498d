"""What the resolver's answers open, on real namespaces: never the network behind the host through
an allowed name, and only for as long as the answer's TTL (the `net` fixture's clock moves time on)."""

from __future__ import annotations

import time

from dnslib import RCODE

from policy import load_policy
from policy.suggest import INTERNAL_ADDRESS, REFUSED_DEST
from runner.net.dns import MIN_OPEN_SECONDS, SWEEP_SECONDS
from tests.net.net_fakes import ALLOWED_HOST, LAN_HOST, lookup, reach

LAN_POLICY = "version: 1\nmode: block\nallow:\n  - host: lan.test\n    ports: [8000]\n"
WEB_POLICY = "version: 1\nmode: block\nallow:\n  - host: web.test\n    ports: [8000]\n"


def answers(guest: str, name: str) -> tuple[int, list[str]]:
    answer = lookup(guest, name)
    assert answer is not None, f"the resolver did not answer {name}"
    return answer.header.rcode, [str(rr.rdata) for rr in answer.rr]


def test_an_allowed_name_answered_with_a_private_address_is_refused(slot, guest) -> None:
    slot.apply_policy(load_policy(LAN_POLICY, "p.yml"))

    assert answers(guest, "lan.test") == (RCODE.REFUSED, [])
    assert not reach(guest, LAN_HOST, 8000)  # the LAN host listens there: nothing was opened
    refused = [r.to_wire() for r in slot.audit_records() if r.reason == INTERNAL_ADDRESS]
    assert refused == [  # the answer, without its address; the attempt by address, which the guest knew
        {"dest": LAN_HOST, "port": 8000, "proto": "tcp", "name": None, "count": 1, "reason": INTERNAL_ADDRESS},
        {"dest": REFUSED_DEST, "port": None, "proto": "dns", "name": "lan.test", "count": 1, "reason": INTERNAL_ADDRESS}]


def test_a_cidr_rule_for_the_private_address_lets_the_name_resolve(slot, guest) -> None:
    slot.apply_policy(load_policy(LAN_POLICY + "  - cidr: 10.0.0.0/24\n    ports: [8000]\n", "p.yml"))

    assert answers(guest, "lan.test") == (RCODE.NOERROR, [LAN_HOST])
    assert reach(guest, LAN_HOST, 8000)
    assert [r for r in slot.audit_records() if r.reason == INTERNAL_ADDRESS] == []


def closed_within(guest: str, seconds: float) -> bool:
    """Whether the guest's connections to the allowed host stop getting through within `seconds`
    (the periodic sweep closes expired openings; nothing here looks the name up again)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        # A generous timeout: a connection that is merely slow on a busy machine must not read as closed.
        if not reach(guest, ALLOWED_HOST, 8000, name="web.test", timeout=5.0):
            return True
        time.sleep(0.2)
    return False


def test_a_public_address_closes_after_its_ttl_until_looked_up_again(net, slot, guest) -> None:
    slot.apply_policy(load_policy(WEB_POLICY, "p.yml"))
    assert answers(guest, "web.test") == (RCODE.NOERROR, [ALLOWED_HOST])  # TTL 60 s
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")

    net.clock.advance(MIN_OPEN_SECONDS - 30)
    assert not closed_within(guest, 3 * SWEEP_SECONDS)  # not yet: sweeps ran, the TTL had not run out
    net.clock.advance(40)
    assert closed_within(guest, 10 * SWEEP_SECONDS)

    assert answers(guest, "web.test") == (RCODE.NOERROR, [ALLOWED_HOST])
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
