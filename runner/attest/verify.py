"""`microvm-check verify`: a job record's signature first, then each artifact it names, by sha256.

The file is an in-toto bundle (`dsse.bundle`): other tools may have added envelopes of their own before
or after ours. Ours is the one envelope of the in-toto payload type whose signature verifies with the
key the caller trusts and whose statement has this project's predicate type; every other line is
ignored, in any order. Nothing of the record is believed before its signature verifies; then every
artifact subject must be in the directory with the digest signed (a missing one fails too: the record
speaks of it). Files in the directory that the record does not name are listed, not failed: the action
writes the envelope itself there.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from runner.attest import dsse
from runner.attest.statement import ENVELOPE_FILE, PAYLOAD_TYPE, Statement
from runner.errors import AttestationError


@dataclass
class Verified:
    statement: Statement
    checked: list[str] = field(default_factory=list)  # artifacts whose digest matched
    unattested: list[str] = field(default_factory=list)  # files in the directory the record does not name


def verify_record(data: bytes, key: Ed25519PublicKey, artifacts: Path | None = None) -> Verified:
    """The record in `data` (a `.intoto.jsonl` bundle), verified with `key`, its artifacts checked in
    `artifacts` when given. AttestationError says what failed."""
    verified = Verified(our_statement(dsse.bundle(data), key))
    if artifacts is not None:
        _check_artifacts(verified, artifacts)
    return verified


def our_statement(envelopes: list[dsse.Envelope], key: Ed25519PublicKey) -> Statement:
    """The one job record among `envelopes` signed with `key`; AttestationError when there is none (a
    changed record is none: its signature no longer verifies) or more than one (which one the caller
    means is not for this function to guess)."""
    ours = []
    for envelope in envelopes:
        if envelope.payload_type != PAYLOAD_TYPE:
            continue
        try:
            ours.append(Statement.parse(envelope.verify(key)))
        except AttestationError:  # another key's, or another predicate type: not ours, ignored
            continue
    if len(ours) == 1:
        return ours[0]
    if ours:
        raise AttestationError(f"{len(ours)} job records signed with this key in one file: keep the one you mean")
    raise AttestationError(f"the signature does not verify with this key: no job record among the file's "
                           f"{len(envelopes)} envelope(s) was signed with it (the record was changed after it was "
                           "signed, or another key signed it)")


def _check_artifacts(verified: Verified, root: Path) -> None:
    problems = []
    named = set()
    for subject in verified.statement.artifacts:
        named.add(subject.name)
        try:
            actual = file_sha256(root, subject.name)
        except OSError as exc:
            problems.append(f"{subject.name}: {exc.strerror or exc}")
            continue
        if actual != subject.sha256:
            problems.append(f"{subject.name}: sha256 {actual}, the record says {subject.sha256}")
        else:
            verified.checked.append(subject.name)
    verified.unattested = sorted(set(_files(root)) - named - {ENVELOPE_FILE})
    if problems:
        raise AttestationError(f"{len(problems)} artifact(s) in {root} are not what the signed record says: "
                               + "; ".join(problems[:20]) + (" ..." if len(problems) > 20 else ""))


def file_sha256(root: Path, name: str) -> str:
    """sha256 of `root/name`, opened without following a link at any step (the files came from a guest)."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise OSError(0, f"not a plain relative name: {name!r}")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
        file_fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(file_fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(0, "not a regular file")
        digest = hashlib.sha256()
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[str]:
    found = []
    for dirpath, _dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            found.append(name if rel == "." else f"{rel}/{name}")
        if len(found) > 100_000:
            break
    return found
