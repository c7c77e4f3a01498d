"""Check runs: documented request bodies, and the log tail bounded to GitHub's limit."""

from __future__ import annotations

import pytest
import responses
from github_fakes import API, assert_valid_request, example

from runner.github.checks import MAX_TEXT, CheckRun, CheckRuns, log_tail
from runner.github.client import GitHubClient

REPO = "github/hello-world"
HEAD = "ce587453ced02b1526dfb4cb910479d431683101"


@pytest.fixture
def checks() -> CheckRuns:
    return CheckRuns(GitHubClient(lambda: "ghs_token", sleep=lambda _: None))


@responses.activate
def test_start_sends_the_documented_body_and_reads_the_answer(checks, operations) -> None:
    answer = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201")
    call = responses.post(f"{API}/repos/{REPO}/check-runs", json=answer, status=201)
    run = checks.start(REPO, HEAD, external_id="job-42")
    assert run == CheckRun(REPO, 4, "https://github.com/github/hello-world/runs/4")
    body = assert_valid_request(call.calls[0].request.body, "POST_repos_owner_repo_check-runs.json",
                                "/repos/{owner}/{repo}/check-runs", "post")
    assert (body["head_sha"], body["status"], body["external_id"]) == (HEAD, "in_progress", "job-42")


@responses.activate
def test_finish_sends_a_bounded_log_tail(checks, operations) -> None:
    answer = example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200")
    call = responses.patch(f"{API}/repos/{REPO}/check-runs/4", json=answer)
    log = "".join(f"line {n}\n" for n in range(20_000)) + "the failure is here\n"
    checks.finish(CheckRun(REPO, 4, ""), "failure", "exit code 1", log)
    body = assert_valid_request(call.calls[0].request.body, "PATCH_repos_owner_repo_check-runs_check_run_id.json",
                                "/repos/{owner}/{repo}/check-runs/{check_run_id}", "patch")
    text = body["output"]["text"]
    assert len(text) <= MAX_TEXT and "the failure is here" in text and "line 0\n" not in text
    assert body["conclusion"] == "failure" and body["status"] == "completed"


def test_finish_rejects_unknown_conclusions(checks) -> None:
    with pytest.raises(ValueError, match="conclusion"):
        checks.finish(CheckRun(REPO, 4, ""), "passed", "", "")


@pytest.mark.parametrize("size", [0, 10, MAX_TEXT - 20, MAX_TEXT, MAX_TEXT * 3])
def test_log_tail_never_exceeds_the_limit(size) -> None:
    log = ("x" * 99 + "\n") * (size // 100) + "y" * (size % 100)
    tail = log_tail(log)
    assert len(tail) <= MAX_TEXT
    assert tail.rstrip("`\n").endswith(log[-50:].rstrip("\n")) if log else tail == "```text\n\n```"


def test_log_with_a_fence_is_sent_unfenced() -> None:
    log = "```\n" * 20_000
    tail = log_tail(log)
    assert len(tail) <= MAX_TEXT and not tail.startswith("```text")
