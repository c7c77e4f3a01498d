"""A job record's guest-derived entries (microvm_check/entries.py): one type each, read back from their
JSON as they were, and held to their rules where they enter a reader (`from_wire`) or the record
(`AuditRecord.checked`)."""

from __future__ import annotations

import pytest

from microvm_check.entries import BLOCK_LISTED_DEST, REFUSED_DEST, Artifact, AuditRecord
from runner.jobapi.contract import JobRecord, JobState, WireError

RECORDS = [
    AuditRecord("203.0.113.10", 443, "tcp", "pypi.org", 2),
    AuditRecord("2001:db8::1", None, "icmpv6", None, 1, "always-denied"),
    AuditRecord("203.0.113.40", 443, "tcp", "pypi.org", 3, "request-refused", "POST", "/legacy/*"),
    AuditRecord("203.0.113.41", 22, "tcp", "git.test", 1, "unnamed", unnamed=True),
    AuditRecord("203.0.113.42", 443, "tcp", "registry.test", 1, "secret-refused", binding="npm_token"),
    AuditRecord(REFUSED_DEST, None, "dns", "lan.test", 4, "internal-address"),
    AuditRecord(BLOCK_LISTED_DEST, None, "dns", "bad.test", 1, "block-listed"),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.reason)
def test_a_record_comes_back_from_its_json_as_it_was(record: AuditRecord) -> None:
    assert AuditRecord.from_wire(record.to_wire()) == record == record.checked()


@pytest.mark.parametrize("record", [AuditRecord("not-an-address", 443, "tcp", None, 1),
                                    AuditRecord("203.0.113.10", 70000, "tcp", None, 1),
                                    AuditRecord("203.0.113.10", 443, "sctp", None, 1),
                                    AuditRecord(REFUSED_DEST, None, "dns", None, 1, "internal-address")])
def test_a_record_that_breaks_the_rules_never_reaches_a_job_record(record: AuditRecord) -> None:
    assert record.checked() is None


def test_a_refused_answer_never_shows_its_address_even_when_an_old_service_sent_it() -> None:
    record = AuditRecord.from_wire({"dest": "10.0.0.5", "port": None, "proto": "dns", "name": "intranet.test",
                                    "count": 1, "reason": "internal-address"})
    assert record is not None and record.dest == REFUSED_DEST


def test_text_is_bounded_and_unknown_words_are_read_as_the_defaults() -> None:
    record = AuditRecord.from_wire({"dest": "203.0.113.10", "port": 8000, "proto": "tcp", "name": "x" * 256,
                                    "count": 0, "reason": "<b>", "method": "TRACE", "path": "/a", "binding": "B!"})
    assert record == AuditRecord("203.0.113.10", 8000, "tcp", None, 1)


@pytest.mark.parametrize("entry", [{"path": "/etc/passwd", "size": 1}, {"path": "a/../../b", "size": 1},
                                   {"path": "", "size": 1}, {"path": "a\0b", "size": 1}, {"path": "a", "size": -1},
                                   {"path": "a", "size": True}, {"path": 3, "size": 1}, ["a", 1]])
def test_an_artifact_entry_is_a_relative_path_and_a_size(entry: object) -> None:
    assert Artifact.from_wire(entry) is None
    assert Artifact.from_wire({"path": "out/report.xml", "size": 12}) == Artifact("out/report.xml", 12)


def test_a_record_leaves_out_an_entry_that_breaks_the_rules_and_refuses_one_that_is_no_object() -> None:
    record = JobRecord("j0123456789abcdef", JobState.FINISHED, "o/r", "a" * 40, None, None, "t",
                       blocked_egress=[RECORDS[0]], artifacts=[Artifact("report.xml", 12)])
    wire = record.to_wire()
    read = JobRecord.from_wire({**wire, "blocked_egress": [*wire["blocked_egress"], {"dest": "nowhere"}],
                                "artifacts": [*wire["artifacts"], {"path": "../x", "size": 1}]})
    assert read == record
    with pytest.raises(WireError, match="blocked_egress: expected a list of JSON objects"):
        JobRecord.from_wire({**wire, "blocked_egress": ["203.0.113.10"]})
