"""An upstream answer with a day-long TTL: the guest is told the clamped TTL, and the addresses it
opened close at the longest opening (runner/net/dns.py, MAX_TTL and MAX_OPEN_SECONDS), on the
`net` fixture's clock. The fake upstream's usual TTL (60 s) is below both clamps, so it pins neither."""

from __future__ import annotations

from dnslib import RCODE

import tests.net.net_fakes as net_fakes
from policy import load_policy
from runner.net.dns import MAX_OPEN_SECONDS, MAX_TTL, SWEEP_SECONDS
from tests.net.net_fakes import ALLOWED_HOST, lookup, reach
from tests.net.test_net_dns_answers import WEB_POLICY, closed_within

DAY = 86400


def test_a_day_long_ttl_reaches_the_guest_clamped_and_its_opening_closes_at_the_maximum(
        net, slot, guest, monkeypatch) -> None:
    monkeypatch.setattr(net_fakes, "TTL", DAY)  # what the fake upstream serves from now on
    slot.apply_policy(load_policy(WEB_POLICY, "p.yml"))

    answer = lookup(guest, "web.test")
    assert answer is not None and answer.header.rcode == RCODE.NOERROR
    assert [(str(rr.rdata), rr.ttl) for rr in answer.rr] == [(ALLOWED_HOST, MAX_TTL)]
    assert MAX_TTL == 300  # the guest keeps an answer five minutes at most
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")

    net.clock.advance(MAX_OPEN_SECONDS - 30)  # past the told TTL, short of the longest opening
    assert not closed_within(guest, 3 * SWEEP_SECONDS)
    net.clock.advance(40)  # past the longest opening (an hour), far short of the day the upstream said
    assert closed_within(guest, 10 * SWEEP_SECONDS)
    assert MAX_OPEN_SECONDS == 3600
