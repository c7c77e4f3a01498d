"""A job record's guest-derived entries (microvm_check/entries.py): one type each, read back from their
JSON as they were, and held to their rules where they enter a reader (`from_wire`) or the record
(`AuditRecord.checked`)."""

from __future__ import annotations

import pytest

from microvm_check.entries import BLOCK_LISTED_DEST, REFUSED_DEST, Artifact, AuditRecord, path_prefix
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


# -- review: each of from_wire's rules, one by one (each of these failed on a mutation that dropped it) --


@pytest.mark.parametrize("port, kept", [(0, False), (1, True), (65535, True), (65536, False), (-1, False)])
def test_a_dialled_port_is_in_range(port: int, kept: bool) -> None:
    record = AuditRecord.from_wire({"dest": "203.0.113.10", "port": port, "proto": "tcp", "name": None, "count": 1})
    assert (record is not None) is kept


def test_a_refused_name_never_carries_an_address() -> None:
    """The resolver gave a refused name no address: a record that says otherwise is no record (it would show
    an address the guest never got on a public summary)."""
    assert AuditRecord.from_wire({"dest": "10.0.0.5", "port": 443, "proto": "tcp", "name": "intranet.test",
                                  "count": 1, "reason": "refused-name"}) is None


def test_a_secret_placeholder_in_a_looked_up_name_is_never_shown() -> None:
    record = AuditRecord.from_wire({"dest": "10.0.0.5", "port": None, "proto": "dns", "count": 1,
                                    "name": "MVC_SECRET_abcdef.evil.test", "reason": "secret-refused",
                                    "binding": "npm_token"})
    assert record is not None and record.name is None and record.dest != "10.0.0.5"
    assert record.binding == "npm_token"


def test_a_binding_is_a_bindings_name_and_only_on_a_secret_refusal() -> None:
    wire = {"dest": "203.0.113.42", "port": 443, "proto": "tcp", "name": None, "count": 1}
    assert AuditRecord.from_wire({**wire, "reason": "secret-refused", "binding": "<b>x</b>"}).binding is None  # type: ignore[union-attr]
    assert AuditRecord.from_wire({**wire, "reason": "policy", "binding": "npm_token"}).binding is None  # type: ignore[union-attr]


def test_a_count_past_its_range_is_read_as_one() -> None:
    wire = {"dest": "203.0.113.10", "port": 443, "proto": "tcp", "name": None}
    assert AuditRecord.from_wire({**wire, "count": 10**9}).count == 10**9  # type: ignore[union-attr]
    assert AuditRecord.from_wire({**wire, "count": 10**9 + 1}).count == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("path", ["/simple/requests?token=s3cret", "/a/b", "/<script>", "/..", "relative"])
def test_a_request_path_is_kept_only_as_its_prefix(path: str) -> None:
    """The rest of a path may carry the job's secrets: a record keeps only `path_prefix`'s shape."""
    record = AuditRecord.from_wire({"dest": "203.0.113.40", "port": 443, "proto": "tcp", "name": "pypi.org",
                                    "count": 1, "reason": "request-refused", "method": "GET", "path": path})
    assert record is not None and record.method == "GET" and record.path is None


@pytest.mark.parametrize("path, prefix", [("/simple/x?y", "/simple/*"), ("/..", "/*"), ("/./a", "/*"),
                                          ("/%2e%2e/a", "/*"), ("", "/"), ("/a", "/a")])
def test_path_prefix_keeps_one_plain_segment_never_a_dot_one(path: str, prefix: str) -> None:
    assert path_prefix(path) == prefix


def test_only_a_tcp_connection_is_unnamed() -> None:
    record = AuditRecord.from_wire({"dest": "203.0.113.41", "port": 53, "proto": "udp", "name": None, "count": 1,
                                    "unnamed": True})
    assert record is not None and record.unnamed is False


def test_an_artifact_path_is_at_most_path_max() -> None:
    assert Artifact.from_wire({"path": "a" * 4096, "size": 1}) == Artifact("a" * 4096, 1)
    assert Artifact.from_wire({"path": "a" * 4097, "size": 1}) is None
