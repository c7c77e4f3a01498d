"""The signed-record formats on their own: DSSE's PAE (the spec's test vector), envelopes the spec allows
(URL-safe base64, several signatures), what a verifier refuses, and the key file's rules."""

from __future__ import annotations

import base64
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from microvm_check.entries import AuditRecord
from runner.attest import dsse
from runner.attest.keys import SigningKey
from runner.attest.statement import PAYLOAD_TYPE, JobPredicate, Statement
from runner.attest.verify import verify_record
from runner.commands.attestation import _sessions
from runner.errors import AttestationError
from runner.jobapi.contract import JobRecord, JobState, RestoredFrom
from runner.service.jobs.attestation import ArtifactFacts, JobAttestor
from runner.service.jobs.job import ARTIFACTS


def test_pae_is_the_specs_test_vector() -> None:
    assert dsse.pae("http://example.com/HelloWorld", b"hello world") == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


def test_lengths_are_bytes_not_characters() -> None:
    assert dsse.pae("t", "é".encode()) == b"DSSEv1 1 t 2 \xc3\xa9"


@pytest.fixture
def key(tmp_path: Path) -> SigningKey:
    return SigningKey.load_or_create(tmp_path / "state" / "attestation-key.pem")


def test_url_safe_base64_and_a_second_signature_of_another_key_verify(key: SigningKey, tmp_path: Path) -> None:
    other = SigningKey.load_or_create(tmp_path / "other.pem")
    payload = b'{"a": "\xff\xfe?>"}'
    envelope = dsse.sign(PAYLOAD_TYPE, payload, key.private, key.keyid)
    obj = envelope.to_json()
    obj["payload"] = base64.urlsafe_b64encode(payload).decode()
    first = dsse.sign(PAYLOAD_TYPE, payload, other.private, other.keyid).to_json()["signatures"]
    obj["signatures"] = first + obj["signatures"]  # type: ignore[operator]
    assert dsse.parse(json.dumps(obj).encode()).verify(key.public) == payload


def test_the_type_is_signed_too(key: SigningKey) -> None:
    obj = dsse.sign(PAYLOAD_TYPE, b"{}", key.private, key.keyid).to_json()
    obj["payloadType"] = "application/json"
    with pytest.raises(AttestationError, match="does not verify"):
        dsse.parse(json.dumps(obj).encode()).verify(key.public)


@pytest.mark.parametrize("text", [b"", b"[]", b'{"payload": "x"}', b'{"payload": "!!", "payloadType": "t", "signatures": []}'])
def test_malformed_envelopes_are_refused(text: bytes) -> None:
    with pytest.raises(AttestationError):
        dsse.parse(text)


def test_the_key_is_made_once_0600_and_a_loose_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "k" / "attestation-key.pem"
    first = SigningKey.load_or_create(path)
    assert SigningKey.load_or_create(path).keyid == first.keyid  # a restart keeps it
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    os.chmod(path, 0o644)
    with pytest.raises(AttestationError, match="mode 0600"):
        SigningKey.read(path)


def _record(state: JobState, **changes: object) -> JobRecord:
    record = JobRecord(id="j1", state=state, repository="o/r", sha="a" * 40, run_id=7, run_attempt=1,
                       job_name="test", policy_digest="sha256:" + "b" * 64)
    record.blocked_egress = [AuditRecord("203.0.113.9", 443, "tcp", "evil.example", 2)]
    for name, value in changes.items():
        setattr(record, name, value)
    return record


def _artifacts(tmp_path: Path, files: dict[str, bytes]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / ARTIFACTS).write_bytes(buf.getvalue())
    return tmp_path / ARTIFACTS


PINNED = "docker://registry.example/node@sha256:" + "c" * 64

JUNIT = (b'<testsuites><testsuite name="s"><testcase name="a"/><testcase name="b"><failure message="m">x</failure>'
         b'</testcase><testcase name="c"><skipped/></testcase></testsuite></testsuites>')


def test_the_service_signs_what_it_counted_and_verify_reads_it_back(key: SigningKey, tmp_path: Path) -> None:
    facts = ArtifactFacts.of(_artifacts(tmp_path, {"out/report.xml": JUNIT, "bin/tool": b"\x00" * 10}))
    assert facts.junit is not None and (facts.junit.tests, facts.junit.failed, facts.junit.skipped) == (3, 1, 1)
    base_manifest = {"name": "base--net--o--r", "digest": "d2", "parent": {"name": "base", "digest": "d1"},
                     "image": {"ref": "docker://registry.example/node:20", "pinned": PINNED,
                               "manifest_digest": "sha256:" + "d" * 64}}
    record = _record(JobState.FINISHED, exit_code=1, restored_from=RestoredFrom.of_manifest(base_manifest, "tcg"))
    assert JobAttestor(key).sign(tmp_path, record, facts)
    data = (tmp_path / "attestation.intoto.jsonl").read_bytes()
    out = tmp_path / "got"
    (out / "out").mkdir(parents=True)
    (out / "bin").mkdir()
    (out / "out" / "report.xml").write_bytes(JUNIT)
    (out / "bin" / "tool").write_bytes(b"\x00" * 10)
    (out / "extra.txt").write_text("not signed")
    verified = verify_record(data, key.public, out)
    assert sorted(verified.checked) == ["bin/tool", "out/report.xml"] and verified.unattested == ["extra.txt"]
    p = verified.statement.predicate
    assert p.junit == {"tests": 3, "passed": 1, "failed": 1, "skipped": 1}
    assert (p.template, p.warmBase, p.image, p.accelerator, p.exitCode) == (
        {"name": "base", "digest": "d1"}, {"name": "base--net--o--r", "digest": "d2"},
        {"ref": PINNED, "digest": "sha256:" + "d" * 64}, "tcg", 1)
    assert p.egressAudit["records"] == 1
    (out / "bin" / "tool").unlink()
    with pytest.raises(AttestationError, match="bin/tool"):  # a named artifact that is missing fails
        verify_record(data, key.public, out)


def test_a_job_without_artifacts_names_itself(key: SigningKey, tmp_path: Path) -> None:
    record = _record(JobState.CANCELLED)
    JobAttestor(key).sign(tmp_path, record, ArtifactFacts())
    statement = Statement.parse(dsse.parse((tmp_path / "attestation.intoto.jsonl").read_bytes()).verify(key.public))
    assert [s.name for s in statement.subjects] == ["job:j1"] and statement.artifacts == ()


def test_a_link_in_the_artifacts_directory_is_not_followed(key: SigningKey, tmp_path: Path) -> None:
    facts = ArtifactFacts.of(_artifacts(tmp_path, {"a/f": b"x"}))
    record = _record(JobState.FAILED)
    JobAttestor(key).sign(tmp_path, record, facts)
    out = tmp_path / "got"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_bytes(b"x")
    (out / "a").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(AttestationError, match="a/f"):
        verify_record((tmp_path / "attestation.intoto.jsonl").read_bytes(), key.public, out)


def test_the_record_says_who_attached_a_terminal_and_a_job_nobody_attached_says_none(key: SigningKey,
                                                                                    tmp_path: Path) -> None:
    def signed(record: JobRecord) -> Statement:
        JobAttestor(key).sign(tmp_path, record, ArtifactFacts())
        return Statement.parse(dsse.parse((tmp_path / "attestation.intoto.jsonl").read_bytes()).verify(key.public))

    assert signed(_record(JobState.FINISHED, exit_code=0)).predicate.terminalSessions == []
    sessions = [{"session": 1, "who": "alice (uid 1001)", "argv": "/bin/bash -i", "attached_at": 1796650000.5,
                 "ended_at": 1796650060.25, "ended": "detached: its program was ended", "bytes_in": 12,
                 "bytes_out": 3400},
                {"session": 2, "who": "root", "argv": "tty", "attached_at": 1796650070.0, "ended_at": None,
                 "ended": None, "bytes_in": 0, "bytes_out": 0}]
    got = signed(_record(JobState.FAILED, terminal_sessions=sessions)).predicate.terminalSessions
    assert got == [{"who": "alice (uid 1001)", "attachedAt": "2026-12-07T13:26:40.500Z",
                    "endedAt": "2026-12-07T13:27:40.250Z", "ended": "detached: its program was ended",
                    "bytesIn": 12, "bytesOut": 3400},
                   {"who": "root", "attachedAt": "2026-12-07T13:27:50.000Z", "endedAt": None, "ended": None,
                    "bytesIn": 0, "bytesOut": 0}]
    assert _sessions([]) == "terminal sessions: none attached"
    assert _sessions(None).startswith("terminal sessions: not recorded")
    shown = _sessions([{"who": "eve\x1b]52;c;x\x07", "attachedAt": "t", "endedAt": None, "ended": None}])
    assert "\x1b" not in shown and "\x07" not in shown and shown.startswith("terminal sessions: 1 attached")


def test_a_record_signed_before_sessions_were_kept_says_nothing_of_them(key: SigningKey, tmp_path: Path) -> None:
    JobAttestor(key).sign(tmp_path, _record(JobState.FINISHED, exit_code=0), ArtifactFacts())
    statement = Statement.parse(dsse.parse((tmp_path / "attestation.intoto.jsonl").read_bytes()).verify(key.public))
    older = statement.to_json()["predicate"]
    del older["terminalSessions"]
    assert JobPredicate.from_json(older).terminalSessions is None
