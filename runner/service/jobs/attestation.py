"""Signed job records: the service signs what each job was, as it ends (runner/attest/ has the formats).

`JobRun.finish` calls `JobAttestor.sign` once, with the final state, exit code and times set and before
the final record is saved: so a client that sees the record final finds its signed record too. The
envelope is the job directory's `attestation.intoto.jsonl`, pruned with the job; the API serves it
(GET /v1/jobs/<id>/attestation) and the public key (GET /v1/attestation-key).

What is signed is the service's own knowledge, never the guest's word: the artifacts' sha256 as the
service validated them (the clean tar), JUnit totals counted by the service from those artifacts
(runner/junit.py, as the action counts), what the VM restored from as the job's record keeps it (template,
warm base, image, accelerator: `RestoredFrom`), the effective policy's digest, the digest of the egress
audit in the job's record, the exit code, the times and the secret bindings the job had (names, hosts,
where each came from and how many requests its value went into; never a value), and the terminal sessions
attached to its VM by then (who, when, how each ended: `terminalSessions`, [] when nobody attached). A
record that cannot be signed (a full disk) is logged; the job keeps its result.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.attest import dsse
from runner.attest.keys import SigningKey
from runner.attest.statement import (
    PAYLOAD_TYPE,
    JobPredicate,
    Statement,
    Subject,
    canonical_digest,
    job_subject,
    rfc3339,
)
from runner.jobapi.contract import RestoredFrom, TemplateRef
from runner.junit import MAX_REPORT_BYTES, JUnitError, Totals, head_looks_like_junit, parse_report
from runner.tarsafe import skip_marker

if TYPE_CHECKING:
    from runner.jobapi.contract import JobRecord

log = logging.getLogger(__name__)

ENVELOPE = "attestation.intoto.jsonl"  # in the job's directory
MAX_JUNIT_REPORTS = 200  # reports the service parses per job; the guest decides how many it leaves


@dataclass(frozen=True)
class ArtifactFacts:
    """The job's artifacts by sha256 and the JUnit totals counted from them: the check run shows the same."""

    subjects: tuple[Subject, ...] = ()
    junit: Totals | None = None

    @classmethod
    def of(cls, tar_path: Path) -> ArtifactFacts:
        """Read the clean artifact tar the service wrote (runner/tarsafe.py `copy_validated`)."""
        if not tar_path.exists():
            return cls()
        subjects, junit, reports = [], None, 0
        with tarfile.open(tar_path, "r:") as tar:
            for member in tar:
                if not member.isfile() or skip_marker(member) is not None:
                    continue
                handle = tar.extractfile(member)
                if handle is None:
                    continue
                digest = hashlib.sha256()
                keep = member.name.endswith(".xml") and member.size <= MAX_REPORT_BYTES and reports < MAX_JUNIT_REPORTS
                data = bytearray()
                while chunk := handle.read(1 << 20):
                    digest.update(chunk)
                    if keep:
                        data += chunk
                subjects.append(Subject(member.name, digest.hexdigest()))
                if keep and head_looks_like_junit(bytes(data[:4096])):
                    reports += 1
                    try:
                        report = parse_report(member.name, bytes(data))
                    except JUnitError as exc:
                        log.info("artifact %s is not a JUnit report the service can count: %s", member.name, exc)
                        continue
                    junit = junit or Totals()
                    junit.add(report)
        return cls(tuple(subjects), junit)


def audit_digest(record: JobRecord) -> str:
    """sha256 of the egress audit in the record (what `jobs show --json` prints as blocked_egress)."""
    return canonical_digest([entry.to_wire() for entry in record.blocked_egress])


def predicate(record: JobRecord, junit: Totals | None) -> JobPredicate:
    vm = record.restored_from or RestoredFrom(None)
    return JobPredicate(
        job={"id": record.id, "repository": record.repository, "sha": record.sha, "runId": record.run_id,
             "runAttempt": record.run_attempt, "job": record.job_name},
        template=_ref(vm.template), warmBase=_ref(vm.base),
        image=None if vm.image is None else {"ref": vm.image.ref, "digest": vm.image.digest},
        policyDigest=record.policy_digest,
        egressAudit={"digest": {"sha256": audit_digest(record)}, "records": len(record.blocked_egress)},
        state=record.state.value, exitCode=record.exit_code,
        junit=None if junit is None else {"tests": junit.tests, "passed": junit.passed, "failed": junit.failed,
                                          "skipped": junit.skipped},
        accelerator=vm.accelerator, startedAt=rfc3339(record.timings.started_at),
        finishedAt=rfc3339(record.timings.finished_at), vmReadyMs=record.timings.vm_ready_ms, error=record.error,
        secretsUsed=[{"name": used.get("name"), "host": used.get("host"), "source": used.get("source"),
                      "requests": used.get("requests")} for used in record.secrets_used],
        terminalSessions=[{"who": session.get("who"), "attachedAt": rfc3339(session.get("attached_at")),
                           "endedAt": rfc3339(session.get("ended_at")), "ended": session.get("ended"),
                           "bytesIn": session.get("bytes_in"), "bytesOut": session.get("bytes_out")}
                          for session in record.terminal_sessions])


class JobAttestor:
    """Signs each job's final record with the service's key (runner/attest/keys.py)."""

    def __init__(self, key: SigningKey) -> None:
        self.key = key

    def envelope(self, job_dir: Path) -> bytes:
        """The job's signed record as `sign` wrote it (FileNotFoundError: not signed)."""
        return (job_dir / ENVELOPE).read_bytes()

    def statement(self, record: JobRecord, artifacts: ArtifactFacts) -> Statement:
        claims = predicate(record, artifacts.junit)
        return Statement(artifacts.subjects or (job_subject(claims),), claims)

    def sign(self, job_dir: Path, record: JobRecord, artifacts: ArtifactFacts) -> bool:
        """Write the job's envelope; False (logged) when it could not be made."""
        try:
            envelope = dsse.sign(PAYLOAD_TYPE, self.statement(record, artifacts).payload(), self.key.private,
                                 self.key.keyid)
            tmp = job_dir / f".{ENVELOPE}.part"
            tmp.write_bytes(envelope.line())
            os.replace(tmp, job_dir / ENVELOPE)
            return True
        except Exception:  # the job's result stands without its signed record; the log says why
            log.exception("job %s: its record could not be signed", record.id)
            return False


def artifact_facts(job_dir: Path, artifacts_name: str) -> ArtifactFacts:
    """`ArtifactFacts.of` the job's clean tar; a tar that cannot be read gives no subjects (logged)."""
    try:
        return ArtifactFacts.of(job_dir / artifacts_name)
    except (OSError, tarfile.TarError):
        log.exception("the artifacts of %s could not be read for its signed record", job_dir.name)
        return ArtifactFacts()


def _ref(template: TemplateRef | None) -> dict[str, str] | None:
    return None if template is None else {"name": template.name, "digest": template.digest}
