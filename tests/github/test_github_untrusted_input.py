"""Arbitrary JSON where a webhook payload or an event file is expected: parsed or refused, never a crash."""

from __future__ import annotations

import json
import logging
import sqlite3
import uuid

import pytest
from github_fakes import event_name, load_payload, webhook_payloads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.github import guard, jobs
from runner.github.signature import sign
from runner.github.webhooks import Answer, WebhookConfig, WebhookReceiver

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
JOB_KEYS = ("id", "run_id", "run_attempt", "name", "labels", "conclusion", "runner_name")


@given(st.dictionaries(st.sampled_from(JOB_KEYS), JSON), JSON)
def test_job_parsing_never_raises(job_fields, repository) -> None:
    payload = load_payload("completed.success.with-organization.payload.json")
    payload["workflow_job"].update(job_fields)
    payload["repository"] = repository
    for parsed in (jobs.queued_job(payload), jobs.completed_job(payload)):
        if parsed is not None:
            assert jobs.REPOSITORY_RE.match(parsed.repository)
            assert all(isinstance(label, str) for label in parsed.labels)
            assert parsed.run_id > 0 and parsed.job_id > 0 and parsed.run_attempt > 0


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(st.sampled_from(["head", "base"]), st.sampled_from(["sha", "repo", "ref"]), JSON)
def test_event_parsing_refuses_or_reads(tmp_path, side, key, value) -> None:
    payload = load_payload("listendev-lstn.pull_request.opened.from-fork.json")
    payload["pull_request"][side][key] = value
    path = tmp_path / "event.json"
    path.write_text(json.dumps(payload))
    env = {"GITHUB_EVENT_NAME": "pull_request", "GITHUB_REPOSITORY": "listendev/lstn", "GITHUB_EVENT_PATH": str(path)}
    try:
        job = guard.job_context(env)
    except guard.GuardError:
        return
    assert job.pull_request is not None and guard.SHA_RE.match(job.pull_request.head_sha)


# -- signed workflow_job deliveries with mutated fields (issue 13, item 7) ------------------------------

SECRET = b"webhook-secret-for-untrusted-input"
WORKFLOW_JOB_PAYLOADS = [path for path in webhook_payloads()
                         if event_name(path) == "workflow_job" and path.suffix == ".json"]
MUTATED_PATHS = [("action",), ("workflow_job",), ("repository",), ("repository", "full_name"),
                 ("workflow_job", "id"), ("workflow_job", "run_id"), ("workflow_job", "run_attempt"),
                 ("workflow_job", "labels"), ("workflow_job", "labels", 0), ("workflow_job", "name"),
                 ("workflow_job", "conclusion"), ("workflow_job", "runner_name")]
DELETE = object()
MUTATIONS = [DELETE, [], {}, None, True, 0, -1, 2**63, 2**64, 10**30, 1.5, 1e308, "", "\ud800", "a\x00b",
             "x" * 5000, [[]], {"a": 1}]


class StorableHooks:
    """The job service's side of the hooks, reduced to what matters here: every job it is handed must
    bind as SQLite parameters, as the service's records do (OverflowError for 2**63, UnicodeEncodeError
    for a lone surrogate), so a value that slipped through parsing turns into a 500 in the test."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:")
        self.jobs: list[jobs.QueuedJob | jobs.CompletedJob] = []

    def prewarm(self, job: jobs.QueuedJob) -> None:
        self._store(job)

    def job_completed(self, job: jobs.CompletedJob) -> None:
        self._store(job)

    def _store(self, job) -> None:
        values = [v for v in vars(job).values() if not isinstance(v, tuple)] + list(job.labels)
        self.db.execute(f"SELECT {', '.join('?' for _ in values)}", values).fetchall()
        self.jobs.append(job)


def _mutated(payload: dict, path: tuple, value) -> dict | None:
    """A copy of `payload` with `value` at `path` (or the key removed); None when the path is absent."""
    copy = json.loads(json.dumps(payload))
    node = copy
    for key in path[:-1]:
        if not isinstance(node, (dict, list)) or (isinstance(node, list) and len(node) <= key) or \
                (isinstance(node, dict) and key not in node):
            return None
        node = node[key]
    last = path[-1]
    if isinstance(node, list) and len(node) <= last or value is DELETE and last not in node:
        return None
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return copy


def _deliver(receiver: WebhookReceiver, payload: dict) -> Answer:
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
               "X-GitHub-Event": "workflow_job", "X-GitHub-Delivery": str(uuid.uuid4()),
               "X-Hub-Signature-256": sign(SECRET, body)}
    assert receiver.check_form("POST", "/github/webhook", headers) is None
    return receiver.deliver(headers, body)


@pytest.mark.parametrize("path", WORKFLOW_JOB_PAYLOADS, ids=lambda p: p.name)
def test_mutated_workflow_job_deliveries_are_never_a_500(path, caplog) -> None:
    """Each field the receiver reads, in every real workflow_job payload, replaced by each wrong type,
    empty, huge and non-Unicode value: a 2xx or 4xx answer, no traceback, and every job handed on fits
    SQLite. `"action": []` was a TypeError and a 500; a run_id of 2**64 reached the job service."""
    caplog.set_level(logging.DEBUG)
    hooks = StorableHooks()
    receiver = WebhookReceiver(WebhookConfig(secret=SECRET, labels=("microvm", "linux", "x64", "k8s", "ubuntu-latest",
                                                                    "tntmac06")), hooks)
    original = json.loads(path.read_text())
    sent = 0
    for field_path in MUTATED_PATHS:
        for value in MUTATIONS:
            payload = _mutated(original, field_path, value)
            if payload is None:
                continue
            answer = _deliver(receiver, payload)
            sent += 1
            assert answer.status < 500, (field_path, value, answer)
    assert sent >= 150
    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
    assert all(0 < job.run_id < 2**63 and 0 < job.run_attempt < 2**63 for job in hooks.jobs)


@pytest.mark.parametrize("action", [[], {}, 1, True])
def test_a_non_string_action_is_a_400(action, caplog) -> None:
    receiver = WebhookReceiver(WebhookConfig(secret=SECRET, labels=("microvm",)), StorableHooks())
    payload = load_payload("queued.payload.json")
    payload["action"] = action
    answer = _deliver(receiver, payload)
    assert (answer.status, answer.message) == (400, f"workflow_job action: expected a string, got {type(action).__name__}")
    assert not [r for r in caplog.records if r.exc_info]


@pytest.mark.parametrize("field, value", [("run_id", 2**63), ("id", 2**64), ("run_attempt", 2**63)])
def test_ids_beyond_64_bits_are_not_a_job(field, value) -> None:
    payload = load_payload("queued.payload.json")
    payload["workflow_job"][field] = value
    assert jobs.queued_job(payload) is None
    payload["workflow_job"][field] = 2**63 - 1
    assert getattr(jobs.queued_job(payload), "job_id" if field == "id" else field) == 2**63 - 1


@pytest.mark.parametrize("field", ["conclusion", "runner_name", "name"])
@pytest.mark.parametrize("value", ["\ud800", "a\nb", "\x00"])
def test_names_that_cannot_be_stored_or_logged_are_dropped(field, value) -> None:
    payload = load_payload("completed.success.with-organization.payload.json")
    payload["workflow_job"][field] = value
    job = jobs.completed_job(payload)
    assert job is not None
    assert {"conclusion": job.conclusion, "runner_name": job.runner_name, "name": job.job_name or None}[field] is None
