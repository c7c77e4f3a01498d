"""Each condition of the name check's gate (runner/net/dns.py, SlotResolver.name_allowed) on its own.

A name-checked connection is admitted only when a name-checked rule allows that name on that port,
the resolver handed the address out for that name, and a name-checked opening of that address and
port is still live. The two names here share one address (as sites on a CDN do), on different
ports, so each condition is the only one that refuses in its case. The clock is the test's own and
no sweep runs: an expired opening is still in the slot's table, as it is between two sweeps, and
only the gate's own expiry check refuses it.
"""

from __future__ import annotations

from tests.net.net_fakes import ALLOWED_HOST, DENIED_HOST, Clock
from tests.net.test_net_units import ask, resolver, service  # noqa: F401  (service: the fixture)

SHARED = ("version: 1\nallow:\n  - host: web.test\n    ports: [8000]\n"
          "  - host: a.cdn.test\n    ports: [9000]\n")


def test_a_name_is_admitted_only_on_its_own_rules_ports_at_a_shared_address(service) -> None:
    dns, _ = service
    slot = resolver(SHARED, [])
    ask(dns, slot, "web.test")
    ask(dns, slot, "a.cdn.test")  # the same address, opened on 9000 for this name

    assert slot.name_allowed("web.test", ALLOWED_HOST, 8000)
    assert slot.name_allowed("a.cdn.test", ALLOWED_HOST, 9000)
    assert not slot.name_allowed("web.test", ALLOWED_HOST, 9000)  # open there, but for the other name
    assert not slot.name_allowed("a.cdn.test", ALLOWED_HOST, 8000)
    assert not slot.name_allowed("web.test", DENIED_HOST, 8000)  # never handed out for it


def test_an_expired_opening_admits_nothing_though_others_at_its_address_live(service) -> None:
    dns, _ = service
    clock = Clock()
    slot = resolver(SHARED + "  - host: a.cdn.test\n    ports: [8000]\n    raw: true\n", [], clock)
    ask(dns, slot, "web.test")  # (address, 8000, checked) open for 60 s
    clock.advance(50)
    ask(dns, slot, "a.cdn.test")  # (address, 9000, checked) and (address, 8000, raw) open until 110 s
    clock.advance(5)
    assert slot.name_allowed("web.test", ALLOWED_HOST, 8000)

    clock.advance(15)  # 70 s: web.test's opening ran out; nothing has swept it yet
    assert not slot.name_allowed("web.test", ALLOWED_HOST, 8000)  # not the raw opening, not the one on 9000
    assert slot.name_allowed("a.cdn.test", ALLOWED_HOST, 9000)
