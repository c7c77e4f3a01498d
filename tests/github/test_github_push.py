"""`push` deliveries: a push to the default branch reaches the hooks (warm bases rebuild), nothing else does.

There is no real push payload under ../shared/external/, so the body is GitHub's documented push
shape (`ref`, `before`, `after`, `created`, `deleted`, `forced`, `commits`, `pusher`) around the
`repository` object of a real captured delivery; the parser reads only `ref`, `after`,
`repository.full_name` and `repository.default_branch`.
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from runner.github.jobs import Push, default_branch_push
from runner.github.signature import sign
from runner.github.webhooks import WebhookConfig, WebhookReceiver
from tests.github.github_fakes import load_payload

SECRET = b"push-webhook-secret-for-tests"
AFTER = "0d1a26e67d8f5eaf1f6ba5c57fc3c7d91ac0fd1c"


@dataclass
class PushHooks:
    pushes: list[Push] = field(default_factory=list)

    def prewarm(self, job: Any) -> None:
        raise AssertionError("a push is not a queued job")

    def job_completed(self, job: Any) -> None:
        raise AssertionError("a push is not a completed job")

    def default_branch_pushed(self, push: Push) -> None:
        self.pushes.append(push)


def push_payload(**changes: Any) -> dict[str, Any]:
    repository = copy.deepcopy(load_payload("listendev-lstn.pull_request.opened.from-fork.json")["repository"])
    payload = {"ref": f"refs/heads/{repository['default_branch']}", "before": "6113728f27ae82c7b1a177c8d03f9e96e0adf246",
               "after": AFTER, "created": False, "deleted": False, "forced": False, "base_ref": None,
               "commits": [], "head_commit": None, "repository": repository,
               "pusher": {"name": "octocat", "email": "octocat@example.com"}}
    payload.update(changes)
    return payload


def deliver(hooks: PushHooks, payload: Any, secret: bytes = SECRET) -> tuple[int, str]:
    receiver = WebhookReceiver(WebhookConfig(secret=SECRET, labels=("microvm",)), hooks)
    body = json.dumps(payload).encode()
    answer = receiver.deliver({"X-Hub-Signature-256": sign(secret, body), "X-GitHub-Event": "push",
                               "X-GitHub-Delivery": str(uuid.uuid4())}, body)
    return answer.status, answer.message


def test_a_push_to_the_default_branch_reaches_the_hooks() -> None:
    hooks = PushHooks()
    payload = push_payload()
    assert payload["repository"]["full_name"] == "listendev/lstn" and payload["ref"] == "refs/heads/main"
    status, message = deliver(hooks, payload)
    assert (status, message) == (200, f"default branch of listendev/lstn at {AFTER[:12]}: its warm bases are rebuilt")
    assert hooks.pushes == [Push("listendev/lstn", AFTER)]


def test_an_unsigned_push_reaches_nothing() -> None:
    hooks = PushHooks()
    status, _ = deliver(hooks, push_payload(), secret=b"not-the-secret")
    assert status == 403 and hooks.pushes == []


@pytest.mark.parametrize("changes", [
    {"ref": "refs/heads/feature"},                              # another branch
    {"ref": "refs/tags/main"},                                  # a tag named like the branch
    {"ref": "refs/tags/simple-tag", "after": "0" * 40, "deleted": True},  # octokit's example: a tag deleted
    {"after": "0" * 40, "deleted": True},                       # the default branch deleted
    {"after": AFTER.upper()},                                   # not how GitHub writes a sha
    {"after": AFTER[:39]},
    {"after": f"../{AFTER}"},
    {"after": None},
    {"ref": ["refs/heads/main"]},
    {"ref": "refs/heads/main" + "x" * 300},
    {"repository": None},
    {"repository": "listendev/lstn"},
])
def test_other_pushes_and_malformed_ones_are_ignored(changes: dict[str, Any]) -> None:
    hooks = PushHooks()
    status, message = deliver(hooks, push_payload(**changes))
    assert (status, message) == (200, "ignored: not a push of a commit to the repository's default branch")
    assert hooks.pushes == []


@pytest.mark.parametrize("repository", [
    {"full_name": "listendev/..", "default_branch": "main"},
    {"full_name": "../etc", "default_branch": "main"},
    {"full_name": "listendev/lstn", "default_branch": "ma\nin"},
    {"full_name": "listendev/lstn", "default_branch": ""},
    {"full_name": "listendev/lstn"},
    {"full_name": 7, "default_branch": "main"},
])
def test_a_repository_that_could_not_be_ours_is_not_a_push(repository: dict[str, Any]) -> None:
    payload = push_payload(repository=repository, ref=f"refs/heads/{repository.get('default_branch')}")
    assert default_branch_push(payload) is None


def test_a_sha256_repository_commit_is_a_commit() -> None:
    after = "ab" * 32
    assert default_branch_push(push_payload(after=after)) == Push("listendev/lstn", after)
