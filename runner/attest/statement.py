"""The in-toto Statement v1 a job's record is, and its predicate (this project's own type).

    {"_type": "https://in-toto.io/Statement/v1",
     "subject": [{"name": "out/report.xml", "digest": {"sha256": "…"}}, …],   # the job's artifacts
     "predicateType": PREDICATE_TYPE,
     "predicate": {"job": {...}, "template": {...}, "warmBase": {...} | null, "policyDigest": "sha256:…",
                   "egressAudit": {"digest": {"sha256": "…"}, "records": N}, "state": "finished",
                   "exitCode": 0, "junit": {"tests": …} | null, "accelerator": "tcg", "startedAt": "…Z",
                   "finishedAt": "…Z", "vmReadyMs": …}}

A job without artifacts has no subject to name; the statement then has one subject, the job itself,
named `job:<id>` with the digest of its own predicate (`job_subject`), so the spec's "at least one
subject" holds, the record is bound to something a verifier recomputes from it, and no two jobs share
the digest (the predicate holds the job's id and times): a consumer that matches records by digest, as
in-toto intends, never takes one job's record for another's, nor for a file that merely holds `[]`.

The predicate type is a URI of this project's own making, versioned in docs/attestation.md: a UUID URN
(RFC 9562) needs no domain, and no one else mints the same one. A predicate that changes incompatibly
gets a new one; verifiers match it exactly.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from runner.errors import AttestationError

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "urn:uuid:d1a758d2-d38b-4456-b536-c60179823b59"  # microvm-check job record, version 1
OPTIONAL = ("vmReadyMs", "error", "secretsUsed", "terminalSessions", "image")  # members a verifier may find absent
ENVELOPE_FILE = "microvm-check.intoto.jsonl"  # written next to the artifacts by the action and `run`
JOB_SUBJECT_PREFIX = "job:"


def canonical_digest(value: object) -> str:
    """sha256 hex of `value` as compact, key-sorted JSON with ASCII escapes: how the egress audit is
    digested here and on the check run (recomputed from the job's record, `jobs show --json`), and how a
    job without artifacts digests its predicate (`job_subject`)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d}Z"


@dataclass(frozen=True)
class Subject:
    name: str
    sha256: str

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "digest": {"sha256": self.sha256}}


@dataclass(frozen=True)
class JobPredicate:
    """What the service claims about one job; every field is the service's own, none the guest's word
    (the JUnit totals are the service's count of the reports the guest left)."""

    job: dict[str, Any]  # id, repository, sha, runId, runAttempt, job
    template: dict[str, str] | None  # name, digest: the recipe template the VM (or its warm base) came from
    warmBase: dict[str, str] | None  # name, digest: the repository's warm base, when the VM restored from one
    image: dict[str, str] | None  # ref, digest: the OCI image `template` was built from; None for a recipe's
    policyDigest: str | None
    egressAudit: dict[str, Any]  # digest {sha256}, records: the blocked-egress records of the job's record
    state: str
    exitCode: int | None
    junit: dict[str, int] | None  # tests, passed, failed, skipped
    accelerator: str | None
    startedAt: str | None
    finishedAt: str | None
    vmReadyMs: float | None = None
    error: str | None = None
    # The job's secret bindings: name, host, source (operator or workflow), requests; never a value.
    secretsUsed: list[dict[str, Any]] = field(default_factory=list)
    # The terminal sessions attached to the job's VM by the time it ended (issue 37): who, attachedAt,
    # endedAt and ended (null while still attached), bytesIn, bytesOut. [] when nobody attached; None (absent)
    # in records signed before sessions were kept, which say nothing either way.
    terminalSessions: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # members a later version adds, kept when read

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data

    @classmethod
    def from_json(cls, data: object) -> JobPredicate:
        if not isinstance(data, dict):
            raise AttestationError("the statement's predicate is not an object")
        names = [f for f in cls.__dataclass_fields__ if f != "extra"]
        missing = [n for n in names if n not in data and n not in OPTIONAL]
        if missing:
            raise AttestationError(f"the predicate lacks {', '.join(missing)}")
        known: dict[str, Any] = {n: data.get(n) for n in names}
        known["secretsUsed"] = known["secretsUsed"] or []  # absent in records signed before it was kept
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})


@dataclass(frozen=True)
class Statement:
    subjects: tuple[Subject, ...]
    predicate: JobPredicate

    def to_json(self) -> dict[str, Any]:
        return {"_type": STATEMENT_TYPE, "subject": [s.to_json() for s in self.subjects],
                "predicateType": PREDICATE_TYPE, "predicate": self.predicate.to_json()}

    def payload(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @property
    def artifacts(self) -> tuple[Subject, ...]:
        """The subjects that name artifacts: all but the job's own (`job_subject`), recognised by its name
        and digest both, so an artifact the guest named `job:...` is still checked as one."""
        own = job_subject(self.predicate)
        return tuple(s for s in self.subjects if s != own)

    @classmethod
    def parse(cls, payload: bytes) -> Statement:
        """The statement in a verified payload; AttestationError when it is not one of ours."""
        try:
            data = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise AttestationError(f"the payload is not JSON: {exc}") from None
        if not isinstance(data, dict) or data.get("_type") != STATEMENT_TYPE:
            raise AttestationError(f"the payload is not an in-toto Statement v1 ({STATEMENT_TYPE})")
        if data.get("predicateType") != PREDICATE_TYPE:
            raise AttestationError(f"the predicate type is {str(data.get('predicateType'))[:200]!r}, not {PREDICATE_TYPE}")
        subjects = data.get("subject")
        if not isinstance(subjects, list) or not subjects:
            raise AttestationError("the statement has no subject")
        parsed = []
        for item in subjects:
            digest = item.get("digest") if isinstance(item, dict) else None
            name, sha = (item.get("name"), digest.get("sha256")) if isinstance(digest, dict) else (None, None)
            if not isinstance(name, str) or not isinstance(sha, str) or len(sha) != 64:
                raise AttestationError("a subject lacks its name or its sha256 digest")
            parsed.append(Subject(name, sha))
        return cls(tuple(parsed), JobPredicate.from_json(data.get("predicate")))


def job_subject(predicate: JobPredicate) -> Subject:
    """The subject of a job without artifacts: `job:<id>`, with the sha256 of its predicate as compact,
    key-sorted JSON (`canonical_digest`, the bytes the signed payload holds for it)."""
    job_id = predicate.job.get("id") if isinstance(predicate.job, dict) else None
    return Subject(f"{JOB_SUBJECT_PREFIX}{job_id}", canonical_digest(predicate.to_json()))
