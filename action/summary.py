"""The step's results for people (`$GITHUB_STEP_SUMMARY`, annotations) and for later steps (outputs).

The job record carries guest-derived text (blocked DNS names, artifact and test names, error text), and
the summary is rendered as GitHub-flavoured Markdown with HTML, so every such value goes through
`runner.markdown.cell` before it goes in: a guest must not be able to inject links, images, mentions,
control characters or fake table rows into the summary.
"""

# No `from __future__ import annotations`: it would bind the name `annotations`, which this module
# defines as a function (mypy rejects the redefinition). Every annotation here names a defined type.

import json
from dataclasses import dataclass

from action.junit import Failure, Totals
from microvm_check.entries import (
    ALWAYS_DENIED,
    BLOCK_LISTED,
    INTERNAL_ADDRESS,
    NAME_REFUSED,
    REFUSED_NAME,
    UNNAMED,
    Artifact,
    AuditRecord,
)
from policy.suggest import narrowed_words, suggest_policy
from runner.jobapi.contract import JobRecord, step_exit_code
from runner.jobapi.workflow import annotation
from runner.markdown import cell, code, fence, inert

MAX_SUGGESTED = 256

MAX_ANNOTATIONS = 10  # GitHub shows at most 10 error annotations per step
MAX_ANNOTATION_CHARS = 4000  # what one annotation message keeps of guest text
MAX_ROWS = 50
GUEST_WORKSPACE = "/workspace/"  # where the checkout is unpacked in the guest (docs/job-api.md)

STATE_WORDS = {
    "finished": "finished",
    "failed": "failed before the command finished",
    "cancelled": "cancelled",
    "timed_out": "timed out",
}


@dataclass(frozen=True)
class Result:
    """Everything the action reports about one job."""

    record: JobRecord
    exit_code: int
    junit: Totals | None
    artifacts: list[Artifact]  # as the action extracted them (`action.artifacts.deliver`)
    refused_artifacts: list[tuple[str, str]]
    log_dropped_bytes: int = 0


def minutes(value: float) -> str:
    """`1 minute`, `0.5 minutes`, `10 minutes`: the step's timeout as people write it."""
    return f"{value:g} minute" + ("" if value == 1 else "s")


def exit_code_of(record: JobRecord) -> int:
    """The step's exit status (`contract.step_exit_code`: the guest's, bounded to 0-255; 1 when the job
    failed without one, 124 when it timed out)."""
    return step_exit_code(record.state, record.exit_code)


def _seconds(start: float | None, end: float | None) -> str:
    if start and end and end >= start:
        return f"{end - start:.1f} s"
    return "–"


def markdown(result: Result) -> str:
    record = result.record
    timings = record.timings
    state = str(record.state.value)
    icon = "✅" if result.exit_code == 0 else "❌"
    ready = timings.vm_ready_ms
    lines = [
        f"### {icon} microvm-check: {cell(STATE_WORDS.get(state, state))}, exit code {result.exit_code}",
        "",
        "| | |",
        "| --- | --- |",
        f"| job | {code(record.id)} |",
        f"| queued | {_seconds(timings.queued_at, timings.started_at)} |",
        f"| ran | {_seconds(timings.started_at, timings.finished_at)} |",
        f"| VM ready | {'–' if ready is None else f'{ready:.0f} ms'}{' (warm)' if record.warm else ''} |",
        f"| policy | {code(record.policy_digest or '–')} |",
    ]
    if record.error:
        lines.append(f"| error | {cell(record.error, 1000)} |")
    if result.junit is not None:
        j = result.junit
        lines.append(f"| tests | {j.passed} passed, {j.failed} failed, {j.skipped} skipped |")
    if result.log_dropped_bytes:
        lines.append(f"| log | truncated, {result.log_dropped_bytes} bytes not shown |")
    lines += _narrowed(record.narrowed_egress)
    lines += _blocked(record.blocked_egress)
    lines += _failures(result.junit.failures if result.junit else [])
    lines += _artifacts(result.artifacts, result.refused_artifacts)
    return "\n".join(lines) + "\n"


def _blocked(blocked: list[AuditRecord]) -> list[str]:
    if not blocked:
        return []
    rows = ["", "#### Blocked egress", "", "| destination | port | proto | name | count | why |",
            "| --- | --- | --- | --- | --- | --- |"]
    for entry in blocked[:MAX_ROWS]:
        port = entry.port  # None for ICMP and for refused DNS answers: no port was tried
        # The destination is never an address the resolver refused: `AuditRecord.from_wire` shows words
        # instead (this summary is public; a fork could CNAME an allowed name to an internal one).
        rows.append(f"| {cell(entry.dest)} | {cell('-' if port is None else port)} | "
                    f"{cell(entry.proto)} | {cell(entry.name or '')} | {entry.count} | {_why(entry.reason)} |")
    if len(blocked) > MAX_ROWS:
        rows.append(f"| … {len(blocked) - MAX_ROWS} more | | | | | |")
    return rows + _suggestion(blocked)


def _narrowed(narrowed: object) -> list[str]:
    words = narrowed_words(narrowed)
    return [] if words is None else ["", f"> **Egress narrowed away:** {cell(words, 2000)}"]


def _refused_answer(item: AuditRecord) -> bool:
    return item.reason == INTERNAL_ADDRESS and item.proto == "dns"


def _why(reason: object) -> str:
    if reason == ALWAYS_DENIED:
        return "always denied (host, metadata or loopback)"
    if reason == INTERNAL_ADDRESS:
        return "an internal address, refused in every mode (a cidr: rule inside its range can allow it)"
    if reason == REFUSED_NAME:
        return "name refused: no rule names it (in block mode the job got NXDOMAIN)"
    if reason == NAME_REFUSED:
        return "the TLS SNI / HTTP Host (name) is not allowed at that address: the host checks names, not just addresses"
    if reason == UNNAMED:
        return ("no checkable name: not TLS or HTTP, no SNI, an encrypted ClientHello or a malformed request "
                "(raw: true on the host entry allows it by address)")
    if reason == BLOCK_LISTED:
        return "on the operator's block list, refused in every mode"
    return "not in the policy"


def _suggestion(blocked: list[AuditRecord]) -> list[str]:
    """The policy that would have let the job do what it tried: how an audit run becomes a policy.
    Only names a policy loads make it in (`policy.suggest.admitted`): they came from the guest's traffic.
    A refused internal answer stays out: the table above explains it, and allowing it is a decision."""
    records = [item for item in blocked[:MAX_SUGGESTED] if not _refused_answer(item)]
    if not records:
        return []
    return ["", "A policy that would allow these attempts (review before adopting it):", "",
            *fence(suggest_policy(records).splitlines(), "yaml")]


def _failures(failures: list[Failure]) -> list[str]:
    if not failures:
        return []
    rows = ["", "#### Failed tests", "", "| test | message |", "| --- | --- |"]
    for f in failures[:MAX_ROWS]:
        name = f"{f.classname}.{f.name}" if f.classname else f.name
        rows.append(f"| {cell(name)} | {cell(_headline(f))} |")
    if len(failures) > MAX_ROWS:
        rows.append(f"| … {len(failures) - MAX_ROWS} more | |")
    return rows


def _headline(failure: Failure) -> str:
    if failure.message:
        return failure.message
    lines = failure.text.strip().splitlines()
    return lines[0] if lines else failure.kind


def _artifacts(files: list[Artifact], refused: list[tuple[str, str]]) -> list[str]:
    rows: list[str] = []
    if files:
        rows += ["", "#### Artifacts", "", "| path | bytes |", "| --- | --- |"]
        rows += [f"| {cell(file.path)} | {file.size} |" for file in files[:MAX_ROWS]]
    if refused:
        rows += ["", "#### Refused artifacts", "", "| path | why |", "| --- | --- |"]
        rows += [f"| {cell(name)} | {cell(why)} |" for name, why in refused[:MAX_ROWS]]
    return rows


def repository_path(file: str | None, prefix: str) -> str | None:
    """A report's file path as a path in the repository, which is what annotations need.

    Relative paths are relative to the working directory (`prefix`); absolute ones are guest paths,
    and only those under the guest's /workspace (the checkout) mean anything on GitHub.
    """
    if not file:
        return None
    if file.startswith(GUEST_WORKSPACE):
        return file[len(GUEST_WORKSPACE):] or None
    if file.startswith("/"):
        return None
    return f"{prefix}{file}"


def guest_annotation(level: str, text: str) -> str:
    """An annotation whose message holds text the guest chose (an artifact's name, a report's error, the
    job's error): `inert`, so no mention, link, control or bidi character reaches the annotation."""
    return annotation(level, inert(text, MAX_ANNOTATION_CHARS, keep="\n\t"))


def annotations(failures: list[Failure], prefix: str = "") -> list[str]:
    """`::error` lines for failed tests; `prefix` is the working directory, as `dir/`. The test's name and
    message are `inert`, as on the check run: no control or bidi character, no mention."""
    lines = []
    for f in failures[:MAX_ANNOTATIONS]:
        title = f"{f.classname}.{f.name}" if f.classname else f.name
        message = f.message or f.text or f.kind
        file = repository_path(f.file, prefix)
        lines.append(annotation("error", inert(message, MAX_ANNOTATION_CHARS, keep="\n\t"), file=file, line=f.line,
                                title=inert(title, 300, keep="\t")))
    if len(failures) > MAX_ANNOTATIONS:
        lines.append(annotation("error", f"{len(failures) - MAX_ANNOTATIONS} more failed tests: see the job summary"))
    return lines


def outputs(result: Result) -> dict[str, str]:
    junit = result.junit
    payload = {
        "record": result.record.to_wire(),
        "exit_code": result.exit_code,
        "junit": None if junit is None else {"tests": junit.tests, "passed": junit.passed,
                                             "failed": junit.failed, "skipped": junit.skipped},
        "artifacts": [artifact.to_wire() for artifact in result.artifacts],
        "refused_artifacts": [{"path": name, "why": why} for name, why in result.refused_artifacts],
    }
    return {
        "exit-code": str(result.exit_code),
        "junit-passed": "" if junit is None else str(junit.passed),
        "junit-failed": "" if junit is None else str(junit.failed),
        "result-json": json.dumps(payload, sort_keys=True),
    }
