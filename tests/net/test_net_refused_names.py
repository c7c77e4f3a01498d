"""Names the resolver refused because no rule names them: in block mode the guest gets NXDOMAIN and
dials nothing, so only the resolver knows; the job's record must list them, marked as refused."""

from __future__ import annotations

from dnslib import RCODE

from action.summary import Result, markdown
from policy import load_policy
from policy.suggest import REFUSED_NAME, REFUSED_NAME_DEST
from tests.action.job_records import job_record
from tests.net.net_fakes import ALLOWED_HOST, lookup, reach

BLOCK = "version: 1\nallow:\n  - host: web.test\n    ports: [8000]\n"


def test_a_name_refused_in_block_mode_is_in_the_record_and_the_summary(slot, guest) -> None:
    slot.apply_policy(load_policy(BLOCK, "block.yml"))

    refused = lookup(guest, "denied.test")
    assert refused is not None and refused.header.rcode == RCODE.NXDOMAIN and not refused.rr
    assert lookup(guest, "denied.test") is not None  # asked twice: counted twice
    answer = lookup(guest, "web.test")
    assert answer is not None and [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")

    blocked = [record.to_wire() for record in slot.audit_records()]  # the job record's blocked_egress
    assert blocked == [{"dest": REFUSED_NAME_DEST, "port": None, "proto": "dns", "name": "denied.test",
                        "count": 2, "reason": REFUSED_NAME}]
    text = markdown(Result(job_record({"id": "j1", "exit_code": 0, "blocked_egress": blocked}), 0, None, [], []))
    assert ("| name refused | - | dns | denied.test | 2 | name refused: no rule names it "
            "(in block mode the job got NXDOMAIN) |") in text
    assert "# denied.test was looked up and refused (no rule names it), so no port was tried" in text


def test_in_audit_mode_a_refused_name_that_was_dialled_is_listed_once_with_its_address(slot, guest) -> None:
    """Audit mode resolves the name anyway: the connection's record carries the name, and no second
    port-less record repeats it. A name only looked up is still listed."""
    slot.apply_policy(load_policy("version: 1\nmode: audit\nallow: []\n", "audit.yml"))

    assert lookup(guest, "web.test") is not None and lookup(guest, "denied.test") is not None
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")

    assert {(r.dest, r.port, r.name, r.reason) for r in slot.audit_records()} == {
        (ALLOWED_HOST, 8000, "web.test", "policy"), (REFUSED_NAME_DEST, None, "denied.test", REFUSED_NAME)}
