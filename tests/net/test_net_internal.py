"""The network behind the runner host, on real namespaces: audit mode never opens it, a broad `cidr:`
rule does not reach it, only a rule inside an internal range does, and what the guest was refused
by name never shows its address in the job's record (a public job summary reads it)."""

from __future__ import annotations

import json
import logging

import pytest
from dnslib import RCODE

from action.summary import Result, markdown
from policy import load_policy, suggest_policy
from policy.suggest import INTERNAL_ADDRESS, POLICY, REFUSED_DEST
from tests.action.job_records import job_record
from tests.net.net_fakes import DENIED_HOST, LAN_HOST, lookup, reach


def answers(guest: str, name: str) -> tuple[int, list[str]]:
    answer = lookup(guest, name)
    assert answer is not None, f"the resolver did not answer {name}"
    return answer.header.rcode, [str(rr.rdata) for rr in answer.rr]


def test_audit_mode_lets_public_egress_through_but_never_the_lan(slot, guest) -> None:
    """The attack: in audit mode FORWARD ended in ACCEPT, so a fork reached the LAN by address."""
    slot.apply_policy(load_policy("version: 1\nmode: audit\nallow: []\n", "audit.yml"))

    assert reach(guest, DENIED_HOST, 8000)  # what block mode would stop, let through and recorded
    assert not reach(guest, LAN_HOST, 8000)  # the LAN host listens there

    records = slot.audit_records()
    assert {(r.dest, r.port, r.proto, r.reason) for r in records} == {
        (DENIED_HOST, 8000, "tcp", POLICY), (LAN_HOST, 8000, "tcp", INTERNAL_ADDRESS)}
    suggested = load_policy(suggest_policy(records), "suggested.yml")
    assert suggested.allows(8000, "tcp", address=DENIED_HOST)
    assert not suggested.allows(8000, "tcp", address=LAN_HOST)  # named in a comment, never allowed


def test_audit_mode_refuses_an_allowed_names_internal_answer(slot, guest) -> None:
    slot.apply_policy(load_policy("version: 1\nmode: audit\nallow:\n  - host: lan.test\n    ports: [8000]\n", "a.yml"))

    assert answers(guest, "lan.test") == (RCODE.REFUSED, [])
    assert not reach(guest, LAN_HOST, 8000)


@pytest.mark.parametrize("mode", ["block", "audit"])
def test_a_rule_for_the_whole_internet_does_not_open_the_lan(slot, guest, mode: str) -> None:
    """`cidr: 0.0.0.0/0` is meant for the internet: it opts into no internal range, by address or by name."""
    slot.apply_policy(load_policy(f"version: 1\nmode: {mode}\nallow:\n  - cidr: 0.0.0.0/0\n    ports: [8000]\n"
                                  "  - host: lan.test\n    ports: [8000]\n", "broad.yml"))

    assert reach(guest, DENIED_HOST, 8000)
    assert not reach(guest, LAN_HOST, 8000)
    assert answers(guest, "lan.test") == (RCODE.REFUSED, [])
    assert (LAN_HOST, 8000, "tcp", INTERNAL_ADDRESS) in {(r.dest, r.port, r.proto, r.reason) for r in slot.audit_records()}


@pytest.mark.parametrize("mode", ["block", "audit"])
def test_a_rule_inside_the_private_range_opts_into_it_in_either_mode(slot, guest, mode: str) -> None:
    slot.apply_policy(load_policy(f"version: 1\nmode: {mode}\nallow:\n  - cidr: 10.0.0.0/24\n    ports: [8000]\n"
                                  "  - host: lan.test\n    ports: [8000]\n", "lan.yml"))

    assert answers(guest, "lan.test") == (RCODE.NOERROR, [LAN_HOST])
    assert reach(guest, LAN_HOST, 8000)
    assert [r for r in slot.audit_records() if r.reason == INTERNAL_ADDRESS] == []


def test_a_cname_to_an_internal_name_leaves_its_address_in_the_service_log_only(slot, guest, caplog) -> None:
    """The attack: a fork points an allowed name at an internal name (CNAME) and, with a split-horizon
    host resolver, would read the internal address from its own job's record and public summary."""
    slot.apply_policy(load_policy("version: 1\nallow:\n  - host: intranet.web.test\n    ports: [8000]\n", "p.yml"))

    with caplog.at_level(logging.INFO, logger="runner.net.dns"):
        assert answers(guest, "intranet.web.test") == (RCODE.REFUSED, [])

    blocked = [record.to_wire() for record in slot.audit_records()]  # the job record's blocked_egress
    assert blocked == [{"dest": REFUSED_DEST, "port": None, "proto": "dns", "name": "intranet.web.test", "count": 1,
                        "reason": INTERNAL_ADDRESS}]
    summary = markdown(Result(job_record({"id": "j", "exit_code": 0, "blocked_egress": blocked}), 0, None, [], []))
    assert LAN_HOST not in json.dumps(blocked) and LAN_HOST not in summary and "intranet.web.test" in summary
    assert any(LAN_HOST in r.getMessage() and "intranet.web.test" in r.getMessage() for r in caplog.records)
