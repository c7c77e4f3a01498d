"""A check run per job: the job's result and the end of its log, visible on the pull request.

GitHub limits a check run's `output.text` to 65535 characters, so only the tail of the log is sent
(the end is where a failure explains itself), cut on a line boundary when one is near.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from runner.github.client import GitHubClient

MAX_TEXT = 65535
MAX_SUMMARY = 65535
CONCLUSIONS = frozenset({"success", "failure", "neutral", "cancelled", "skipped", "timed_out", "action_required"})
TAIL_HEADER = "(log truncated: last part shown)\n"
FENCE_OPEN, FENCE_CLOSE = "```text\n", "\n```"


@dataclass(frozen=True)
class CheckRun:
    repository: str
    id: int
    html_url: str


def log_tail(log: str, limit: int = MAX_TEXT) -> str:
    """The log's end, fenced as text, never longer than `limit` characters."""
    room = limit - len(FENCE_OPEN) - len(FENCE_CLOSE)
    fence = "```" in log  # a fence inside the log would end ours early; then send it unfenced
    if fence:
        room = limit
    if len(log) > room:
        cut = log[-(room - len(TAIL_HEADER)):]
        newline = cut.find("\n")
        if 0 <= newline < 200:
            cut = cut[newline + 1 :]
        log = TAIL_HEADER + cut
    return log if fence else f"{FENCE_OPEN}{log}{FENCE_CLOSE}"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class CheckRuns:
    def __init__(self, client: GitHubClient, name: str = "microvm-check") -> None:
        self.client = client
        self.name = name

    def start(self, repository: str, head_sha: str, external_id: str) -> CheckRun:
        body = {
            "name": self.name,
            "head_sha": head_sha,
            "status": "in_progress",
            "external_id": external_id,
            "started_at": _now(),
            "output": {"title": "Running in a microVM", "summary": "", "text": ""},
        }
        answer = self.client.post(f"/repos/{repository}/check-runs", body)
        return CheckRun(repository, int(answer["id"]), str(answer.get("html_url", "")))

    def finish(self, run: CheckRun, conclusion: str, summary: str, log: str) -> None:
        if conclusion not in CONCLUSIONS:
            raise ValueError(f"conclusion must be one of {sorted(CONCLUSIONS)}, not {conclusion!r}")
        body = {
            "status": "completed",
            "conclusion": conclusion,
            "completed_at": _now(),
            "output": {
                "title": f"microvm-check: {conclusion}",
                "summary": summary[:MAX_SUMMARY],
                "text": log_tail(log),
            },
        }
        self.client.patch(f"/repos/{run.repository}/check-runs/{run.id}", body)
