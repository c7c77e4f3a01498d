"""Audit mode: attempts are recorded with the names the resolver handed out, and the suggested
policy lets the same job pass in block mode."""

from __future__ import annotations

import socket
import time

from policy import load_policy, suggest_policy
from runner.net import netns
from tests.net.net_fakes import ALLOWED_HOST, DENIED_HOST, lookup, reach


def the_job(guest: str) -> tuple[bool, bool]:
    """What the audited job does: one host by name, one by bare address."""
    answer = lookup(guest, "web.test")
    assert answer is not None and [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]
    return reach(guest, ALLOWED_HOST, 8000, name="web.test"), reach(guest, DENIED_HOST, 8000)


def test_audit_records_and_suggested_policy_passes_in_block_mode(net, slot, guest) -> None:
    slot.apply_policy(load_policy("version: 1\nmode: audit\nallow: []\n", "audit.yml"))

    assert the_job(guest) == (True, True)  # audit lets everything through
    records = slot.audit_records()  # NFLOG hands each packet over at once; reading drains it all

    assert {(r.dest, r.port, r.proto, r.name) for r in records} == {
        (ALLOWED_HOST, 8000, "tcp", "web.test"),
        (DENIED_HOST, 8000, "tcp", None),
    }
    assert all(r.count >= 1 for r in records)
    suggestion = suggest_policy(records)

    net.pool.release(slot)
    again = net.pool.acquire(job="same-job-block-mode")
    assert again.netns == slot.netns  # the pool of one hands back the cleaned slot the guest sits on
    assert again.audit_records() == []
    blocking = load_policy(suggestion, "suggested.yml")
    assert blocking.mode == "block"
    again.apply_policy(blocking)

    assert the_job(guest) == (True, True)
    assert not reach(guest, ALLOWED_HOST, 9000, name="web.test")  # and nothing more than the job needed
    blocked = again.audit_records()
    assert [(r.dest, r.port) for r in blocked] == [(ALLOWED_HOST, 9000)]


def test_a_flood_of_denied_packets_is_logged_at_a_bounded_rate(slot, guest) -> None:
    """The host parses NFLOG on the loop that answers every VM's DNS: a hostile guest must not be able
    to hand it unbounded work. Records under a flood are a lower bound, and still name the destination."""
    slot.apply_policy(load_policy("version: 1\nmode: block\nallow: []\n", "block.yml"))
    flood = 5000
    sender = netns.socket_in(guest, socket.AF_INET, socket.SOCK_DGRAM)
    started = time.monotonic()
    with sender:
        for _ in range(flood):
            try:
                sender.sendto(b"x", (DENIED_HOST, 9))
            except OSError:  # ICMP errors from earlier rejects surface on later sends
                pass
    elapsed = time.monotonic() - started

    counted = {(r.dest, r.port): r.count for r in slot.audit_records()}
    assert 1 <= counted[(DENIED_HOST, 9)] <= 200 + 100 * elapsed + 10  # the burst, then 100 a second
    time.sleep(0.1)  # the bucket refills: the next attempt is logged again
    assert not reach(guest, ALLOWED_HOST, 8000, name="web.test")
    assert (ALLOWED_HOST, 8000) in {(r.dest, r.port) for r in slot.audit_records()}


def test_attempts_before_the_job_policy_is_loaded_are_not_the_jobs(slot, guest) -> None:
    """A warm-pool VM runs in its slot before a job claims it; what it tried then (the guard logs
    always-denied hits whatever the policy) must not end up in the job's blocked egress."""
    metadata = ("169.254.169.254", 80)
    sender = netns.socket_in(guest, socket.AF_INET, socket.SOCK_DGRAM)
    with sender:
        sender.sendto(b"x", metadata)
        assert metadata in {(r.dest, r.port) for r in slot.audit_records()}  # logged while pooled

        slot.apply_policy(load_policy("version: 1\nmode: block\nallow: []\n", "block.yml"))
        assert slot.audit_records() == []

        sender.sendto(b"x", metadata)  # the job's own attempt is recorded
        assert [(r.dest, r.port, r.reason) for r in slot.audit_records()] == [(*metadata, "always-denied")]
