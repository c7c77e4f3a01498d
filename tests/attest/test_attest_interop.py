"""The signed record as other tools read it: an in-toto bundle in which another tool's lines sit around ours
(the bundle spec: unknown lines ignored, order meaningless), a keyid that go-securesystemslib (cosign,
sigstore-go) derives itself, a documented predicate type of the project's own, a job subject unique to
the job, and securesystemslib's DSSE verifying a record with the script docs/attestation.md gives."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from runner.attest import dsse
from runner.attest.keys import SigningKey, keyid
from runner.attest.statement import PAYLOAD_TYPE, PREDICATE_TYPE, Statement, Subject, canonical_digest
from runner.attest.verify import verify_record
from runner.errors import AttestationError
from runner.jobapi.contract import JobRecord, JobState
from runner.service.jobs.attestation import ArtifactFacts, JobAttestor

DOC = Path(__file__).resolve().parents[2] / "docs" / "attestation.md"


@pytest.fixture
def key(tmp_path: Path) -> SigningKey:
    return SigningKey.load_or_create(tmp_path / "state" / "attestation-key.pem")


def _record(job_id: str) -> JobRecord:
    record = JobRecord(id=job_id, state=JobState.FINISHED, repository="o/r", sha="a" * 40, run_id=7, run_attempt=1,
                       job_name="test", policy_digest="sha256:" + "b" * 64, exit_code=0)
    record.blocked_egress = []
    return record


def _signed(key: SigningKey, job_dir: Path, job_id: str = "j1") -> bytes:
    job_dir.mkdir(parents=True, exist_ok=True)
    assert JobAttestor(key).sign(job_dir, _record(job_id), ArtifactFacts())
    return (job_dir / "attestation.intoto.jsonl").read_bytes()


def _foreign(tmp_path: Path) -> tuple[bytes, bytes]:
    """Two lines another tool could have put in the bundle: an in-toto envelope of another key, and an
    envelope of a payload type of its own (the bundle spec's example: a scanner's CBOR)."""
    other = SigningKey.load_or_create(tmp_path / "other.pem")
    statement = json.dumps({"_type": "https://in-toto.io/Statement/v1", "predicateType": "https://spdx.dev/Document",
                            "subject": [{"name": "x", "digest": {"sha256": "0" * 64}}], "predicate": {}}).encode()
    return (dsse.sign(PAYLOAD_TYPE, statement, other.private, other.keyid).line(),
            dsse.sign("application/vnd.novulz+cbor", b"\xa1\x01\x02", other.private, other.keyid).line())


JUNK = b"not json at all\n\n[1, 2]\n" + b"[" * 100_000 + b"\n{\"payload\": 3}\n"


def test_a_foreign_line_before_ours_and_junk_after_it_verify(key: SigningKey, tmp_path: Path) -> None:
    ours = _signed(key, tmp_path / "j1")
    intoto, cbor = _foreign(tmp_path)
    verified = verify_record(intoto + cbor + ours + JUNK, key.public)
    assert verified.statement.predicate.job["id"] == "j1"
    assert verify_record(JUNK + ours + cbor, key.public).statement == verified.statement  # order means nothing


def _altered(line: bytes) -> bytes:
    """Our envelope line with the statement's exit code changed, the signature left as it was."""
    envelope = json.loads(line)
    statement = json.loads(base64.b64decode(envelope["payload"]))
    statement["predicate"]["exitCode"] = 1
    envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    return json.dumps(envelope).encode() + b"\n"


def test_our_line_altered_does_not_verify(key: SigningKey, tmp_path: Path) -> None:
    intoto, cbor = _foreign(tmp_path)
    with pytest.raises(AttestationError, match="does not verify with this key: no job record"):
        verify_record(intoto + _altered(_signed(key, tmp_path / "j1")) + cbor + JUNK, key.public)


def test_two_records_of_this_key_in_one_file_are_not_guessed_between(key: SigningKey, tmp_path: Path) -> None:
    with pytest.raises(AttestationError, match="2 job records"):
        verify_record(_signed(key, tmp_path / "j1", "j1") + _signed(key, tmp_path / "j2", "j2"), key.public)


def test_two_jobs_without_artifacts_have_different_subject_digests(key: SigningKey, tmp_path: Path) -> None:
    first, second = (verify_record(_signed(key, tmp_path / j, j), key.public).statement for j in ("j1", "j2"))
    assert [s.name for s in first.subjects] == ["job:j1"] and first.artifacts == ()
    assert first.subjects[0].sha256 != second.subjects[0].sha256
    assert first.subjects[0].sha256 != canonical_digest([])  # not the empty egress audit's, as it was
    assert first.subjects[0].sha256 == canonical_digest(first.predicate.to_json())  # recomputable from the record


def test_an_artifact_named_like_the_job_subject_is_still_an_artifact(key: SigningKey, tmp_path: Path) -> None:
    """The guest names its artifacts: one called `job:j1` is checked like any other, not taken for the
    job's own subject (that one is recognised by its digest too)."""
    statement = JobAttestor(key).statement(_record("j1"), ArtifactFacts())
    assert statement.artifacts == ()
    named = Statement((Subject("job:j1", "f" * 64),), statement.predicate)
    assert named.artifacts == named.subjects


def test_the_keyid_is_the_openssh_fingerprint_cosign_derives() -> None:
    """The vector: OpenSSH 9.2's `ssh-keygen -lf` for the Ed25519 key whose seed is bytes 0..31 printed
    `256 SHA256:lbmsoA0yIEcEiVDRnMWuzm+nV+3ZEEpVIURqFoeSspg no comment (ED25519)`."""
    public = Ed25519PrivateKey.from_private_bytes(bytes(range(32))).public_key()
    assert keyid(public) == "SHA256:lbmsoA0yIEcEiVDRnMWuzm+nV+3ZEEpVIURqFoeSspg"


def test_the_predicate_type_is_the_projects_own_uri_and_documented() -> None:
    name = PREDICATE_TYPE.removeprefix("urn:uuid:")
    assert PREDICATE_TYPE.startswith("urn:uuid:") and str(uuid.UUID(name)) == name
    assert f"| 1 (this page) | `{PREDICATE_TYPE}` |" in DOC.read_text()


def _doc_script() -> str:
    """The securesystemslib script in docs/attestation.md, as a reader would copy it."""
    section = DOC.read_text().split("### Without microvm-check: securesystemslib", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "docs/attestation.md lost its securesystemslib script"
    return match.group(1)


def test_securesystemslib_verifies_a_record_with_the_documented_script(key: SigningKey, tmp_path: Path) -> None:
    script = tmp_path / "verify_record.py"
    script.write_text(_doc_script())
    (tmp_path / "service.pub").write_text(key.public_pem)
    intoto, cbor = _foreign(tmp_path)
    ours = _signed(key, tmp_path / "j1")
    statement = verify_record(ours, key.public).statement

    def run(bundle: bytes) -> subprocess.CompletedProcess[str]:
        (tmp_path / "bundle.intoto.jsonl").write_bytes(bundle)
        return subprocess.run([sys.executable, str(script), str(tmp_path / "bundle.intoto.jsonl"),
                               str(tmp_path / "service.pub")], capture_output=True, text=True, timeout=60)

    done = run(intoto + JUNK + ours + cbor)
    assert (done.returncode, done.stdout) == (0, f"{statement.subjects[0].sha256} 'job:j1'\n"), done.stderr
    done = run(intoto + _altered(ours) + cbor)
    assert done.returncode == 1 and "no job record signed with this key" in done.stderr


def test_verify_prints_the_record_subject_of_a_job_without_artifacts(key: SigningKey, tmp_path: Path) -> None:
    """What the securesystemslib script prints for such a record, `verify` prints too: the two can be matched."""
    from runner.commands.attestation import describe

    verified = verify_record(_signed(key, tmp_path / "j1"), key.public)
    assert f"record subject: {verified.statement.subjects[0].sha256}  job:j1 " in describe(verified, None)
