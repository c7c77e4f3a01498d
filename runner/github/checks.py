"""A check run per job on the pull request's head commit: what the maintainer sees on the PR itself.

    POST  /repos/{owner}/{repo}/check-runs                 status in_progress, when the job's VM starts
    PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}  annotations 50 at a time, then the conclusion

The shapes are GitHub's (the check-runs OpenAPI fragments under shared/external/rest-api/, which the
tests validate every request against, formats included). Everything of the guest's that goes in is made
inert first: the summary's values through `runner.markdown.cell` (as the step summary does), the egress
section from the job record's typed entries (`microvm_check.entries.AuditRecord`: an address, a port, a
protocol, a known method and a path prefix) with only a name the policy loader accepts
(`policy.suggest.admitted`) and annotation fields through
`runner.markdown.inert`, bounded to GitHub's sizes, with a path only when it is a plain relative path in
the repository.

The summary carries the job's signed-record digests (the policy, the egress audit, each artifact's
sha256, the key's id) so a maintainer can match the check run with `microvm-check verify`'s output; it
is built so that nothing the guest controls can push them out (`summary`). A final update GitHub
refuses (422) is sent again with a short body of the service's own values, so the check run ends.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policy.suggest import REFUSED_IN_EVERY_MODE, AuditRecord, admitted, suggest_policy
from runner.attest.statement import Subject
from runner.github.errors import GitHubError, ValidationFailed
from runner.junit import Failure
from runner.markdown import cell, code, fence, inert

if TYPE_CHECKING:
    from runner.github.client import GitHubClient

log = logging.getLogger(__name__)

MAX_ANNOTATIONS_PER_REQUEST = 50  # GitHub's limit (the fragment's maxItems)
MAX_ANNOTATIONS = 500  # per check run: the guest decides how many failures and findings there are
MAX_SUMMARY = 65535  # output.summary and output.text maxLength
MAX_TITLE = 255
MAX_MESSAGE = 4000  # GitHub allows 64 KB; a PR page does not need more of a guest's text
MAX_ROWS = 50  # of each table: artifacts, egress attempts, findings without a file
MAX_FINDINGS = 200
# The summary's sections after the conclusion, most important first, each at most this many bytes of
# what the ones before it left (`summary`); the last one, findings without a file, takes the rest.
MAX_RECORD_SECTION = 16_000
MAX_SECRETS_SECTION = 8_000
MAX_EGRESS_SECTION = 16_000
MAX_SNIPPET_SECTION = 16_000
# `::error file=app.py,line=3,title=T::message` as a tool prints it (GitHub's workflow-command syntax)
_FINDING = re.compile(r"^::(error|warning|notice)(?: ([^:]*))?::(.*)$")
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/@+-]{1,500}")
GUEST_WORKSPACE = "/workspace/"
CONCLUSIONS = {"finished": None, "failed": "failure", "cancelled": "cancelled", "timed_out": "timed_out"}


@dataclass(frozen=True)
class Finding:
    """One annotation: a failed test or a `::error`-style line of the job's output."""

    level: str  # notice | warning | failure
    message: str
    title: str = ""
    path: str | None = None  # a plain relative path in the repository; without one it is no annotation
    line: int | None = None

    def to_json(self) -> dict[str, Any]:
        assert self.path is not None, "an annotation needs a file of the repository"
        line = self.line or 1
        found: dict[str, Any] = {"path": self.path, "start_line": line, "end_line": line, "annotation_level": self.level,
                                 "message": inert(self.message, MAX_MESSAGE, keep="\n\t") or "(no message)"}
        if self.title:
            found["title"] = inert(self.title, MAX_TITLE, keep="\t")
        return found


@dataclass(frozen=True)
class JobOutcome:
    """What the check run says about one ended job (built by the service from its record and facts)."""

    job_id: str
    state: str
    exit_code: int | None
    duration_s: float | None
    vm_ready_ms: float | None
    junit: tuple[int, int, int] | None  # passed, failed, skipped
    findings: tuple[Finding, ...]
    blocked_egress: tuple[AuditRecord, ...]
    mode: str  # the effective policy's: block or audit
    digests: dict[str, str] = field(default_factory=dict)  # policy, egress audit, key id
    artifacts: tuple[Subject, ...] = ()  # the signed record's subjects: each artifact's name and sha256
    error: str | None = None
    # The job's secret bindings (docs/secrets.md): name, host, source, requests; never a value.
    secrets_used: tuple[dict[str, Any], ...] = ()
    restored_from: str | None = None  # what the VM restored from (`RestoredFrom.describe`); None: no VM started

    @property
    def conclusion(self) -> str:
        fixed = CONCLUSIONS.get(self.state, "failure")
        return fixed or ("success" if self.exit_code == 0 else "failure")


def failure_findings(failures: Iterable[Failure], prefix: str = "") -> list[Finding]:
    """JUnit failures as annotations (at their file and line when the report gives a repository path)."""
    found = []
    for f in failures:
        title = f"{f.classname}.{f.name}" if f.classname else f.name
        found.append(Finding("failure", f.message or f.text or f.kind, title, _repository_path(f.file, prefix), f.line))
    return found


def output_findings(lines: Iterable[str]) -> list[Finding]:
    """`::error`/`::warning`/`::notice` lines of the job's output (a linter's findings), bounded."""
    found: list[Finding] = []
    for raw in lines:
        match = _FINDING.match(raw.rstrip("\r\n"))
        if match is None:
            continue
        kind, props, data = match.groups()
        fields = {k: _unescape(v, _PROPERTY_ESCAPES) for k, v in
                  (p.split("=", 1) for p in (props or "").split(",") if "=" in p)}
        message = _unescape(data, _DATA_ESCAPES)
        line = fields.get("line", "")
        found.append(Finding({"error": "failure", "warning": "warning", "notice": "notice"}[kind], message,
                             fields.get("title", ""), _repository_path(fields.get("file"), ""),
                             int(line) if line.isdigit() and 0 < int(line) < 10_000_000 else None))
        if len(found) >= MAX_FINDINGS:
            break
    return found


def egress_tried(outcome: JobOutcome) -> tuple[list[AuditRecord], list[AuditRecord]]:
    """(refused, audit-only) records, named only by a name the policy loader accepts: what the guest had
    refused, and in audit mode what it did that the policy (the default branch's, within the org default)
    does not allow."""
    records = [r for r in map(admitted, outcome.blocked_egress) if r is not None]
    if outcome.mode == "block":
        return records, []
    return ([r for r in records if r.reason in REFUSED_IN_EVERY_MODE],
            [r for r in records if r.reason not in REFUSED_IN_EVERY_MODE])


def summary(outcome: JobOutcome) -> str:
    """The check run's output.summary (Markdown), at most MAX_SUMMARY bytes whatever the guest did.

    Sections, most important first, each within its budget and what the ones before it left: the
    conclusion, the signed record's digests, the secret bindings the job had, the egress the policy
    refused, the policy snippet, the findings that name no file. So a guest's text or traffic can
    shorten only what comes after the digests, a cut section says how much it left out, and no cut
    falls inside a code block. Every guest-derived value goes through `cell` (the snippet through
    `policy.suggest`'s admission)."""
    parts = [_text(_conclusion(outcome))]
    left = MAX_SUMMARY - _size(parts[0])
    for section, cap in ((_signed_record, MAX_RECORD_SECTION), (_secrets_table, MAX_SECRETS_SECTION),
                         (_egress_table, MAX_EGRESS_SECTION),
                         (_snippet, MAX_SNIPPET_SECTION), (_unplaced, MAX_SUMMARY)):
        text = _text(section(outcome, min(cap, left)))
        parts.append(text)
        left -= _size(text)
    return "".join(parts)


def plain_summary(outcome: JobOutcome) -> str:
    """The summary sent when GitHub refused the full one (422): the conclusion and the service's own
    digests only, no text of the guest's, so nothing in it can be refused again."""
    return _text([
        f"**{outcome.conclusion}**, exit code {outcome.exit_code if outcome.exit_code is not None else '–'}", "",
        "GitHub refused this check run's full summary; the job's record and its signed record have the rest.",
        "", "| | |", "| --- | --- |", f"| job | {code(outcome.job_id)} |",
        *(f"| {name} | {code(value)} |" for name, value in outcome.digests.items()),
        f"| artifacts | {len(outcome.artifacts)}, `microvm-check verify` lists them |"])


def _conclusion(outcome: JobOutcome) -> list[str]:
    """The state, exit code, times and totals: bounded by construction (its one guest text, the error,
    is at most 1000 characters of Markdown), far below the summary's limit."""
    ready = f"{outcome.vm_ready_ms:.0f} ms" if outcome.vm_ready_ms is not None else "–"
    took = f"{outcome.duration_s:.1f} s" if outcome.duration_s is not None else "–"
    lines = [f"**{cell(outcome.state)}**, exit code {cell(outcome.exit_code if outcome.exit_code is not None else '–')}",
             "", "| | |", "| --- | --- |", f"| job | {code(outcome.job_id)} |", f"| duration | {took} |",
             f"| VM ready | {ready} |"]
    if outcome.restored_from is not None:
        lines.append(f"| restored from | {cell(outcome.restored_from, 600)} |")
    if outcome.junit is not None:
        passed, failed, skipped = outcome.junit
        lines.append(f"| tests (JUnit) | {passed} passed, {failed} failed, {skipped} skipped |")
    if outcome.error:
        lines.append(f"| error | {cell(outcome.error, 1000)} |")
    unplaced = _unplaced_findings(outcome)
    if unplaced:
        lines.append(f"| findings without a file | {len(unplaced)}, listed at the end |")
    return lines


def _signed_record(outcome: JobOutcome, budget: int) -> list[str]:
    head = ["", "#### Signed record", "", "Match these with `microvm-check verify` on the job's "
            "`microvm-check.intoto.jsonl`:", "", "| | sha256 |", "| --- | --- |"]
    head += [f"| {cell(name)} | {code(value)} |" for name, value in outcome.digests.items()]
    rows = [f"| artifact {cell(subject.name)} | {code(subject.sha256)} |" for subject in outcome.artifacts[:MAX_ROWS]]
    return _fit(head, rows, len(outcome.artifacts),
                lambda n: f"| … {n} more artifacts, `microvm-check verify` lists them all | |", budget)


def _secrets_table(outcome: JobOutcome, budget: int) -> list[str]:
    """The job's secret bindings and how many requests each value went into (the service's own values)."""
    if not outcome.secrets_used:
        return []
    head = ["", "#### Secret bindings", "", "The job's guest had placeholders for these; the host sent each value "
            "only in the requests its binding admits:", "", "| binding | host | from | requests |",
            "| --- | --- | --- | --- |"]
    rows = [f"| {cell(used.get('name'))} | {cell(used.get('host'))} | {cell(used.get('source'))} | "
            f"{cell(used.get('requests'))} |" for used in outcome.secrets_used[:MAX_ROWS]]
    return _fit(head, rows, len(outcome.secrets_used), lambda n: f"| … {n} more | | | |", budget)


def _egress_table(outcome: JobOutcome, budget: int) -> list[str]:
    refused, audited = egress_tried(outcome)
    head = ["", "#### Egress this pull request tried", ""]
    if not refused and not audited:
        return head + ["Nothing outside the repository's policy."]
    head += ["What the job's VM tried that the repository's policy (its default branch's, within the org default) "
             "does not allow" + (" — audit mode: it was let through and recorded" if audited else "") + ":", "",
             "| name | address | port | proto | method | path | count | |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = [f"| {cell(record.name or '–')} | {cell(record.dest)} | {cell(record.port or '–')} | "
            f"{cell(record.proto)} | {cell(record.method or '–')} | {cell(record.path or '–')} | "
            f"{cell(record.count)} | {'refused' if record in refused else 'audit'} |"
            for record in (refused + audited)[:MAX_ROWS]]
    return _fit(head, rows, len(refused) + len(audited), lambda n: f"| … {n} more | | | | | | | |", budget)


def _snippet(outcome: JobOutcome, budget: int) -> list[str]:
    """The policy that would allow the first attempts (as many as the table can list, fewer when their
    YAML does not fit), in a code block that always closes, and how many attempts it leaves out."""
    refused, audited = egress_tried(outcome)
    tried = refused + audited
    taken = min(len(tried), MAX_ROWS)
    while taken:
        lines = ["", "A policy that would allow these (`policy suggest`; review it, and add what you accept to the "
                     "default branch's policy in a commit of your own):", "",
                 *fence(suggest_policy(tried[:taken]).splitlines(), "yaml")]
        if taken < len(tried):
            lines += ["", f"It covers the first {taken} of {len(tried)} attempts; `microvm-check policy suggest "
                          "--repository OWNER/NAME` on the service's host merges them all."]
        if _size(_text(lines)) <= budget:
            return lines
        taken //= 2
    return []


def _unplaced(outcome: JobOutcome, budget: int) -> list[str]:
    """Failures and findings that name no file of the repository: no annotation shows them."""
    unplaced = _unplaced_findings(outcome)
    if not unplaced:
        return []
    head = ["", "#### Findings without a file", "", "| level | title | message |", "| --- | --- | --- |"]
    rows = [f"| {f.level} | {cell(f.title or '–')} | {cell(f.message)} |" for f in unplaced[:MAX_ROWS]]
    return _fit(head, rows, len(unplaced), lambda n: f"| … {n} more | | |", budget)


def _unplaced_findings(outcome: JobOutcome) -> list[Finding]:
    return [f for f in outcome.findings if not f.path]


def _fit(head: list[str], rows: list[str], total: int, more: Callable[[int], str], budget: int) -> list[str]:
    """`head` and as many of `rows` (the first of `total`) as fit in `budget` bytes, with a `more` line
    saying how many were left out; nothing when not even `head` and that line fit."""
    used = _size(_text(head))
    kept: list[str] = []
    for index, row in enumerate(rows):
        after = 0 if index + 1 == total else _size(_text([more(total - index - 1)]))  # the `more` line it needs
        if used + _size(_text([row])) + after > budget:
            break
        kept.append(row)
        used += _size(_text([row]))
    if len(kept) < total:
        kept.append(more(total - len(kept)))
    lines = head + kept
    return lines if _size(_text(lines)) <= budget else []


def _text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def _size(text: str) -> int:
    """The length GitHub's limit is checked against, counted in UTF-8 bytes: never below its count of
    characters, however it counts them."""
    return len(text.encode())


def annotation_payloads(outcome: JobOutcome) -> list[dict[str, Any]]:
    """The findings that name a file of the repository (GitHub annotates files), bounded."""
    return [finding.to_json() for finding in outcome.findings if finding.path][:MAX_ANNOTATIONS]


class CheckRuns:
    """The check-runs API of one repository installation, as the App (`checks: write`)."""

    def __init__(self, client: GitHubClient) -> None:
        self.client = client

    def start(self, repository: str, head_sha: str, name: str, job_id: str, started_at: str | None,
              details_url: str | None = None) -> int:
        """Create the check run in progress; `started_at` (RFC 3339) when the VM's start time is known."""
        body: dict[str, Any] = {"name": name, "head_sha": head_sha, "status": "in_progress", "external_id": job_id,
                                "output": {"title": "running in a fresh microVM",
                                           "summary": f"Job {code(job_id)} is running."}}
        if started_at:
            body["started_at"] = started_at
        if details_url:
            body["details_url"] = details_url
        answer = self.client.post(f"/repos/{repository}/check-runs", body)
        check_id = answer.get("id") if isinstance(answer, dict) else None
        if not isinstance(check_id, int) or isinstance(check_id, bool):
            raise GitHubError(f"creating the check run of {repository}@{head_sha[:12]}: the answer has no id")
        return check_id

    def complete(self, repository: str, check_id: int, outcome: JobOutcome, completed_at: str | None) -> int:
        """Post the annotations in batches of 50 (GitHub appends each batch), the last batch with the
        conclusion. When GitHub refuses one of them (422), what is left is sent as one final update with
        `plain_summary` and no annotations, so the check run ends all the same. Returns the number of
        PATCH requests sent."""
        title = f"{outcome.conclusion}: exit code {outcome.exit_code if outcome.exit_code is not None else '–'}"
        text = summary(outcome)
        found = annotation_payloads(outcome)
        batches: list[Sequence[dict[str, Any]]] = [found[i:i + MAX_ANNOTATIONS_PER_REQUEST]
                                                    for i in range(0, len(found), MAX_ANNOTATIONS_PER_REQUEST)] or [[]]
        path = f"/repos/{repository}/check-runs/{check_id}"
        end: dict[str, Any] = {"status": "completed", "conclusion": outcome.conclusion}
        if completed_at:
            end["completed_at"] = completed_at
        for sent, batch in enumerate(batches, 1):
            output: dict[str, Any] = {"title": title, "summary": text}
            if batch:
                output["annotations"] = list(batch)
            try:
                self.client.patch(path, {"output": output, **(end if sent == len(batches) else {})})
            except ValidationFailed as exc:
                log.warning("check run %s of %s: GitHub refused update %d of %d (%s); ending it with a short "
                            "summary", check_id, repository, sent, len(batches), exc)
                self.client.patch(path, {"output": {"title": title, "summary": plain_summary(outcome)}, **end})
                return sent + 1
        return len(batches)


def _repository_path(file: str | None, prefix: str) -> str | None:
    """A report's path as a path in the repository, only when it is a plain relative one."""
    if not file:
        return None
    if file.startswith(GUEST_WORKSPACE):
        file = file[len(GUEST_WORKSPACE):]
    elif not file.startswith("/"):
        file = prefix + file
    else:
        return None
    parts = file.split("/")
    if not _SAFE_PATH.fullmatch(file) or any(p in ("", ".", "..") for p in parts) or parts[0] == ".git":
        return None
    return file


# How a tool escapes a workflow command's message and property values (GitHub's toolkit does the same).
_DATA_ESCAPES = (("%0D", "\r"), ("%0A", "\n"), ("%25", "%"))
_PROPERTY_ESCAPES = (("%3A", ":"), ("%2C", ","), *_DATA_ESCAPES)


def _unescape(text: str, escapes: tuple[tuple[str, str], ...]) -> str:
    for escaped, char in escapes:
        text = text.replace(escaped, char)
    return text
