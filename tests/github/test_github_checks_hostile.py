"""A guest that does its worst to the check run: it dials 5,000 addresses, prints 100,000 `::error` lines
whose names carry `@mentions`, NUL, ESC and U+202E, and leaves hundreds of artifacts with such names. The
summary still fits GitHub's limit with the signed record's digests in it, every code block closes,
cmark-gfm renders nothing of the guest's that links, mentions or controls, and the annotations carry
no control character either. Every request is checked against GitHub's check-runs fragment."""

from __future__ import annotations

import re
from dataclasses import replace

import responses

from microvm_check.entries import AuditRecord
from runner.attest.statement import Subject
from runner.github.checks import MAX_SUMMARY, CheckRuns, JobOutcome, output_findings, summary
from runner.github.client import GitHubClient
from tests.gfm import acting, render
from tests.github.github_fakes import API, assert_valid_request, example

REPO = "octo-org/hello"
UPDATE = ("PATCH_repos_owner_repo_check-runs_check_run_id.json", "/repos/{owner}/{repo}/check-runs/{check_run_id}",
          "patch")
NASTY = "@someone \x00 \x1b[31mred \u202egnp.exe mail me@example.org www.evil.example https://evil.example #1"
TITLE = NASTY.replace("%", "%25").replace(":", "%3A").replace(",", "%2C")  # as a tool escapes a property
DIGESTS = {"policy": "sha256:" + "a" * 64, "egress audit": "b" * 64, "signing key": "SHA256:" + "c" * 43}


def _dialled(count: int) -> tuple[AuditRecord, ...]:
    """`count` refused connections, as the job record's blocked_egress entries are."""
    return tuple(AuditRecord(f"10.{n // 65536}.{n // 256 % 256}.{n % 256}", 443, "tcp", f"h{n}.evil.example", 1, "policy")
                 for n in range(count))


def _hostile() -> JobOutcome:
    lines = [f"::error file=src/app.py,line={n % 900 + 1},title={TITLE}::{NASTY}" if n % 2 else f"::error::{NASTY}"
             for n in range(100_000)]
    return JobOutcome(job_id="j1", state="finished", exit_code=1, duration_s=12.0, vm_ready_ms=900.0, junit=(1, 2, 0),
                      findings=tuple(output_findings(lines)), blocked_egress=_dialled(5000), mode="block",
                      digests=DIGESTS, artifacts=tuple(Subject(f"{n} {NASTY}", f"{n:064x}") for n in range(400)),
                      error=NASTY * 50)


@responses.activate
def test_a_hostile_guest_cannot_push_out_the_signed_record_nor_render_markup(operations) -> None:
    updated = example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200")
    responses.patch(f"{API}/repos/{REPO}/check-runs/7", json=updated, status=200)
    outcome = _hostile()
    CheckRuns(GitHubClient(lambda: "ghs_token")).complete(REPO, 7, outcome, "2026-12-01T20:01:00.250Z")
    bodies = [assert_valid_request(call.request.body, *UPDATE) for call in responses.calls]
    text = bodies[-1]["output"]["summary"]
    assert bodies[-1]["status"] == "completed" and text == summary(outcome)

    record = text.split("#### Signed record", 1)[-1].split("####", 1)[0]
    assert all(value in record for value in DIGESTS.values())
    assert len(text.encode()) <= MAX_SUMMARY  # bytes: never fewer than GitHub's count, however it counts
    assert re.search(r"\| … \d+ more artifacts", record)  # cut, and says so
    assert "| … 4950 more |" in text and "It covers the first 50 of 5000 attempts" in text

    fences = [line for line in text.splitlines() if line.startswith("```")]
    assert fences and len(fences) % 2 == 0
    html = render(text)
    assert html.count("<pre") == len(fences) // 2 and "<h4>Findings without a file</h4>" in html  # closed
    assert acting(html) == []

    annotations = [a for body in bodies for a in body["output"].get("annotations", [])]
    assert len(annotations) == 100  # of the first 200 findings, every other one names a file
    for text in [a["message"] for a in annotations] + [a["title"] for a in annotations]:
        assert not re.search(r"[\x00\x1b\u202e]|@[A-Za-z0-9]", text), text


def test_the_snippet_is_never_cut_inside_its_code_block() -> None:
    """However many attempts, the summary's code blocks are whole: the snippet shrinks, never splits."""
    outcome = _hostile()
    for count in (1, 49, 50, 51, 5000):
        text = summary(replace(outcome, blocked_egress=_dialled(count)))
        fences = [line for line in text.splitlines() if line.startswith("```")]
        assert len(fences) == 2, count
        assert ("It covers the first" in text) is (count > 50)
