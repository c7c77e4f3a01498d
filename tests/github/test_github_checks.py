"""The check run per job against GitHub's check-runs fragments: created in progress, annotations sent 50 at
a time (GitHub appends them), completed with the conclusion; a guest's Markdown, HTML and workflow-command
tricks arrive inert; the egress section lists what the job tried with a policy snippet that loads."""

from __future__ import annotations

import json
import re

import pytest
import responses

from microvm_check.entries import AuditRecord
from policy.load import load_policy
from runner.attest.statement import Subject
from runner.github.checks import (
    MAX_ANNOTATIONS_PER_REQUEST,
    CheckRuns,
    Finding,
    JobOutcome,
    failure_findings,
    output_findings,
    summary,
)
from runner.github.client import GitHubClient
from runner.junit import parse_report
from tests.github.github_fakes import API, assert_valid_request, example

REPO = "octo-org/hello"
CREATE = ("POST_repos_owner_repo_check-runs.json", "/repos/{owner}/{repo}/check-runs", "post")
UPDATE = ("PATCH_repos_owner_repo_check-runs_check_run_id.json", "/repos/{owner}/{repo}/check-runs/{check_run_id}",
          "patch")
HOSTILE = "<img src=x onerror=alert(1)> [click](https://evil.example) ![i](https://evil.example/i.png) `x` | col"
COMMAND_TRICK = "::add-mask::x\n::set-output name=ok::1"


def _client() -> GitHubClient:
    return GitHubClient(lambda: "ghs_token")


def _outcome(**changes: object) -> JobOutcome:
    fields: dict[str, object] = dict(
        job_id="j1", state="finished", exit_code=1, duration_s=12.5, vm_ready_ms=900.0, junit=(1, 60, 0),
        findings=tuple(Finding("failure", f"test {n} failed", f"t.test_{n}", "tests/test_t.py", n + 1) for n in range(120)),
        blocked_egress=({"dest": "10.0.0.9", "port": 443, "proto": "tcp", "name": "pypi.evil.example", "count": 3,
                         "reason": "policy", "method": "POST", "path": "/upload"},),
        mode="block", digests={"policy": "sha256:" + "a" * 64, "egress audit": "b" * 64, "key": "sha256:" + "c" * 64},
        artifacts=(Subject("out/report.xml", "d" * 64),))
    fields.update(changes)
    fields["blocked_egress"] = tuple(map(AuditRecord.from_wire, fields["blocked_egress"]))  # type: ignore[call-overload]
    return JobOutcome(**fields)  # type: ignore[arg-type]


@responses.activate
def test_created_in_progress_then_annotations_in_batches_then_completed(operations) -> None:
    created = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201",
                      "application/json:example-of-in-progress-conclusion")
    updated = example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200")
    responses.post(f"{API}/repos/{REPO}/check-runs", json=created, status=201)
    responses.patch(f"{API}/repos/{REPO}/check-runs/{created['id']}", json=updated, status=200)
    checks = CheckRuns(_client())
    check_id = checks.start(REPO, "a" * 40, "microvm-check / test", "j1", "2026-12-01T20:00:00Z",
                            "https://ci.example.org/ui/jobs/j1")
    assert check_id == created["id"]
    start = assert_valid_request(responses.calls[0].request.body, *CREATE)
    assert (start["status"], start["external_id"], start["details_url"]) == ("in_progress", "j1",
                                                                          "https://ci.example.org/ui/jobs/j1")
    sent = checks.complete(REPO, check_id, _outcome(), "2026-12-01T20:01:00Z")
    assert sent == 3  # 120 annotations: 50 + 50 + 20
    patches = [assert_valid_request(call.request.body, *UPDATE) for call in responses.calls[1:]]
    assert [len(p["output"].get("annotations", [])) for p in patches] == [50, 50, 20]
    assert all(len(p["output"]["annotations"]) <= MAX_ANNOTATIONS_PER_REQUEST for p in patches)
    assert ["conclusion" in p for p in patches] == [False, False, True]  # completed last, after every batch
    assert (patches[-1]["status"], patches[-1]["conclusion"]) == ("completed", "failure")
    lines = {a["start_line"] for p in patches for a in p["output"]["annotations"]}
    assert lines == set(range(1, 121))


@responses.activate
def test_a_job_without_findings_completes_in_one_request(operations) -> None:
    updated = example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200")
    responses.patch(f"{API}/repos/{REPO}/check-runs/4", json=updated, status=200)
    assert CheckRuns(_client()).complete(REPO, 4, _outcome(findings=(), exit_code=0), "2026-12-01T20:01:00Z") == 1
    body = assert_valid_request(responses.calls[0].request.body, *UPDATE)
    assert body["conclusion"] == "success" and "annotations" not in body["output"]


def test_the_guests_markdown_html_and_commands_are_inert() -> None:
    junit = parse_report("r.xml", (
        f'<testsuite name="s"><testcase classname="c" name="{HOSTILE.replace("<", "&lt;")}" file="/etc/passwd">'
        f'<failure message="{HOSTILE.replace("<", "&lt;")}">{COMMAND_TRICK}</failure></testcase></testsuite>').encode())
    findings = failure_findings(junit.failures) + output_findings(
        ["::error file=../../etc/shadow,line=2::" + HOSTILE, "::warning file=src/app.py,line=7,title=lint::" + HOSTILE,
         "plain output"])
    outcome = _outcome(findings=tuple(findings), error=HOSTILE,
                       blocked_egress=({"dest": "10.0.0.9", "port": 443, "proto": "tcp", "name": HOSTILE, "count": 1},),
                       artifacts=(Subject(HOSTILE, "e" * 64),))
    text = summary(outcome)
    for trick in ("<img", "](", "![", "`x`", "| col"):
        assert trick not in text
    assert not re.search(r"https?://", text)
    assert [f.path for f in findings] == [None, None, "src/app.py"]  # outside the repository: no file
    payload = [f.to_json() for f in findings if f.path]
    assert payload[0]["message"] == HOSTILE and payload[0]["title"] == "lint"  # annotations are plain text on GitHub
    assert "pypi" not in text  # a name the policy loader refuses never shows, as in the step summary


def test_the_egress_section_lists_names_ports_methods_and_a_snippet_that_loads() -> None:
    text = summary(_outcome())
    assert "| pypi.evil.example | 10.0.0.9 | 443 | tcp | POST | /upload | 3 | refused |" in text.replace("&#58;", ":")
    snippet = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    policy = load_policy(snippet, "snippet")
    assert [r.host for r in policy.rules] == ["pypi.evil.example"]
    assert "sha256:" + "a" * 64 in text.replace("&#58;", ":") and "d" * 64 in text  # the signed record's digests


def test_audit_mode_says_it_let_the_attempts_through() -> None:
    text = summary(_outcome(mode="audit"))
    assert "audit mode" in text and "| audit |" in text


@pytest.mark.parametrize("state,code,conclusion", [("finished", 0, "success"), ("finished", 2, "failure"),
                                                   ("timed_out", 124, "timed_out"), ("cancelled", 130, "cancelled"),
                                                   ("failed", None, "failure")])
def test_conclusions(state: str, code: int | None, conclusion: str) -> None:
    assert _outcome(state=state, exit_code=code).conclusion == conclusion


def test_fragment_examples_still_have_the_shape_we_read(operations) -> None:
    created = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201")
    assert isinstance(created["id"], int) and json.dumps(created)


@responses.activate
def test_a_time_the_service_does_not_know_is_left_out_never_sent_empty(operations) -> None:
    """GitHub refuses a check run whose started_at or completed_at is no date-time (the fragments' format)."""
    created = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201")
    responses.post(f"{API}/repos/{REPO}/check-runs", json=created, status=201)
    responses.patch(f"{API}/repos/{REPO}/check-runs/{created['id']}",
                    json=example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200"))
    checks = CheckRuns(_client())
    checks.complete(REPO, checks.start(REPO, "a" * 40, "microvm-check", "j1", None), _outcome(findings=()), None)
    start, end = (call.request.body for call in responses.calls)
    assert "started_at" not in assert_valid_request(start, *CREATE)
    assert "completed_at" not in assert_valid_request(end, *UPDATE)
