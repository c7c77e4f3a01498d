"""`microvm-check attestation | attestation-key | verify`: a job's signed record, the key, and checking one.

`attestation JOB` and `attestation-key` ask the running service (--socket) or read its state directly
(--config, as `jobs --config` does). `verify FILE` checks the envelope's signature with a key the caller
trusts (--key PUB, or the service's on --socket), then each artifact's sha256 in --artifacts DIR, and
prints what the record claims. Its exit status is 0 only when everything checked out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from runner.attest.keys import SigningKey, load_public
from runner.attest.statement import Statement
from runner.attest.verify import Verified, verify_record
from runner.errors import AttestationError, UserError
from runner.jobapi.contract import DEFAULT_SOCKET

MAX_FILE_BYTES = 8 * 1024 * 1024


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    show = subparsers.add_parser("attestation", help="print a job's signed record (a DSSE envelope line)")
    show.add_argument("id", help="the job's id (as `jobs` lists it)")
    key = subparsers.add_parser("attestation-key", help="print the public key the service signs job records with")
    for parser, func in ((show, cmd_attestation), (key, cmd_attestation_key)):
        parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"ask the running service (default {DEFAULT_SOCKET})")
        parser.add_argument("--config", type=Path, help="read this service config's state directly instead")
        parser.set_defaults(func=func)

    verify = subparsers.add_parser(
        "verify", help="check a signed job record and its artifacts",
        description="Check FILE's signature (a microvm-check.intoto.jsonl) with --key, or with the key of the service "
                    "on --socket, then the sha256 of each artifact it names in --artifacts DIR; print what the "
                    "record claims. Exit 0 only when all of it checks out.")
    verify.add_argument("file", type=Path, help="the envelope (artifacts/microvm-check.intoto.jsonl)")
    verify.add_argument("--key", type=Path, help="the service's public key (PEM, as attestation-key prints it)")
    verify.add_argument("--socket", help=f"take the key from the service on this socket (default {DEFAULT_SOCKET} "
                                         "when --key is not given)")
    verify.add_argument("--artifacts", type=Path, metavar="DIR", help="check the artifacts in DIR against the record")
    verify.add_argument("--json", action="store_true", help="print the verified statement as JSON")
    verify.set_defaults(func=cmd_verify)


def cmd_attestation(args: argparse.Namespace) -> int:
    if args.config:
        from runner.service.config.reading import load_config
        from runner.service.jobs.attestation import ENVELOPE

        path = load_config(args.config).jobs_dir / Path(args.id).name / ENVELOPE
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise UserError(f"{path}: {exc.strerror} (has job {args.id} ended? `jobs --config` lists them)") from None
    else:
        data = _api(args.socket, lambda client: client.attestation(args.id))
    sys.stdout.buffer.write(data)
    return 0


def cmd_attestation_key(args: argparse.Namespace) -> int:
    if args.config:
        from runner.service.config.reading import load_config

        print(SigningKey.read(load_config(args.config).attestation_key_path).public_pem, end="")
    else:
        print(_api(args.socket, lambda client: client.attestation_key()), end="")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    if args.key and args.socket:
        raise UserError("give the key either as --key or through --socket, not both")
    if args.key:
        public = load_public(_read(args.key), str(args.key))
    else:
        socket = args.socket or DEFAULT_SOCKET
        public = load_public(_api(socket, lambda client: client.attestation_key()).encode(), f"the service on {socket}")
    if args.artifacts is not None and not args.artifacts.is_dir():
        raise UserError(f"--artifacts {args.artifacts}: not a directory")
    try:
        verified = verify_record(_read(args.file), public, args.artifacts)
    except AttestationError as exc:
        raise AttestationError(f"{args.file}: NOT verified: {exc}") from None
    if args.json:
        print(json.dumps(verified.statement.to_json(), indent=2, sort_keys=True))
    else:
        print(describe(verified, args.artifacts))
    return 0


def describe(verified: Verified, artifacts: Path | None) -> str:
    """What a verified record claims, for a terminal: every value shown inert (names come from the job)."""
    statement: Statement = verified.statement
    p = statement.predicate
    job: dict[str, Any] = p.job if isinstance(p.job, dict) else {}
    junit = p.junit
    lines = [
        "signature: good",
        f"job {_t(job.get('id'))}: {_t(job.get('repository'))}@{_t(job.get('sha'))} run {_t(job.get('runId'))} "
        f"attempt {_t(job.get('runAttempt'))} job {_t(job.get('job'))}",
        f"result: {_t(p.state)}, exit code {_t(p.exitCode)}" + (f" ({_t(p.error)})" if p.error else ""),
        "tests (JUnit): " + (f"{junit.get('tests')} run, {junit.get('passed')} passed, {junit.get('failed')} failed, "
                             f"{junit.get('skipped')} skipped" if isinstance(junit, dict) else "no report"),
        f"VM: template {_ref(p.template)}, warm base {_ref(p.warmBase)}, accelerator {_t(p.accelerator)}, "
        f"ready in {_t(p.vmReadyMs)} ms",
        f"egress: policy {_t(p.policyDigest)}; audit sha256:{_t((p.egressAudit.get('digest') or {}).get('sha256'))} "
        f"({_t(p.egressAudit.get('records'))} records)",
        f"times: started {_t(p.startedAt)}, finished {_t(p.finishedAt)}",
    ]
    lines.append(_sessions(p.terminalSessions))
    subjects = statement.artifacts
    if artifacts is None:
        lines.append(f"artifacts: {len(subjects)} named, not checked (pass --artifacts DIR)")
    else:
        lines.append(f"artifacts: all {len(verified.checked)} named match in {_t(artifacts)}")
        if verified.unattested:
            lines.append(f"  not in the record ({len(verified.unattested)}): "
                         + ", ".join(_t(n) for n in verified.unattested[:20]))
    for subject in subjects[:200]:
        lines.append(f"  {subject.sha256}  {_t(subject.name)}")
    for subject in (s for s in statement.subjects if s not in subjects):
        lines.append(f"record subject: {subject.sha256}  {_t(subject.name)} (the digest of its predicate: the job "
                     "had no artifacts)")
    return "\n".join(lines)


def _sessions(sessions: list[dict[str, Any]] | None) -> str:
    """The record's terminal sessions: none, who attached when, or that the record predates them."""
    if sessions is None:
        return "terminal sessions: not recorded (signed before they were kept)"
    if not sessions:
        return "terminal sessions: none attached"
    shown = [f"  {_t(s.get('who'))} at {_t(s.get('attachedAt'))}, ended {_t(s.get('endedAt'))}: {_t(s.get('ended'))}"
             for s in sessions[:50] if isinstance(s, dict)]
    return "\n".join([f"terminal sessions: {len(sessions)} attached", *shown])


def _ref(value: object) -> str:
    return f"{_t(value.get('name'))} ({_t(value.get('digest'))})" if isinstance(value, dict) else "-"


def _t(value: object) -> str:
    """A value of the record for a terminal: control characters shown as '?', bounded."""
    text = "-" if value is None else str(value)
    return "".join(c if c.isprintable() else "?" for c in text[:300])


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UserError(f"{path}: over {MAX_FILE_BYTES} bytes: not a key or a job record")
    return data


def _api(socket: str, call: Any) -> Any:
    from runner.jobapi.client import JobAPIError, JobClient

    try:
        with JobClient(socket=socket) as client:
            return call(client)
    except JobAPIError as exc:
        hint = " (is the service running? pass its --socket, or --config to read its state)" if exc.status is None else ""
        raise UserError(f"{exc}{hint}") from exc
