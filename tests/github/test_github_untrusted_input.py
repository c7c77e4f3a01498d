"""Arbitrary JSON where a webhook payload or an event file is expected: parsed or refused, never a crash."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
import uuid

import pytest
import responses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.github import guard, jobs
from runner.github.app import parse_timestamp
from runner.github.client import GitHubClient
from runner.github.deliveries import RedeliverySweep
from runner.github.signature import sign
from runner.github.webhooks import Answer, WebhookConfig, WebhookReceiver
from tests.github.github_fakes import event_name, load_payload, webhook_payloads

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
        self.jobs: list[jobs.QueuedJob | jobs.InProgressJob | jobs.CompletedJob] = []

    def prewarm(self, job: jobs.QueuedJob) -> None:
        self._store(job)

    def job_in_progress(self, job: jobs.InProgressJob) -> None:
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
    assert answer.status == 400
    assert answer.message == f"workflow_job action: expected a string, got {type(action).__name__}"
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


# -- the redelivery sweep reads GitHub's list of deliveries: every record is checked, none stops it -------

DELIVERIES = "https://api.github.com/app/hook/deliveries"


def _delivery_item(id_, guid: str = "9b0a5c2e-1d1f-11ef-8c3e-1a2b3c4d5e6f", status_code=502) -> dict:
    """A `hook-delivery-item` as GitHub lists it (see tests/github/test_github_deliveries.py)."""
    return {"id": id_, "guid": guid, "delivered_at": "2026-11-30T11:59:00Z", "redelivery": False,
            "duration": 0.27, "status": "Invalid HTTP Response: 502", "status_code": status_code,
            "event": "workflow_job", "action": "queued", "installation_id": 123, "repository_id": 456}


POISON_RECORDS = [
    _delivery_item(float("inf")),  # int(inf): OverflowError, which the old sweep did not catch
    _delivery_item(1e400),
    _delivery_item(2**64),
    _delivery_item(True),
    _delivery_item(7, guid={"a": 1}),
    _delivery_item(7, guid="x" * 5000),
    _delivery_item(7, status_code=[]),
    {**_delivery_item(7), "delivered_at": "\ud800"},
    {**_delivery_item(7), "redelivery": "yes"},
]


@pytest.mark.parametrize("poison", POISON_RECORDS, ids=range(len(POISON_RECORDS)))
@responses.activate
def test_a_sweep_skips_a_record_it_cannot_read(poison, caplog) -> None:
    clock = lambda: parse_timestamp("2026-11-30T12:00:00Z")  # noqa: E731
    sweep = RedeliverySweep(GitHubClient(lambda: "jwt", clock=clock, sleep=lambda s: None), window=3600, clock=clock)
    responses.get(DELIVERIES, json=[poison, _delivery_item(4, guid="guid-good")])
    attempt = responses.post(f"{DELIVERIES}/4/attempts", status=202, json={})
    assert sweep.sweep() == [4] and attempt.call_count == 1
    assert all(len(r.getMessage()) < 400 for r in caplog.records)


@responses.activate
def test_the_sweep_thread_goes_on_after_a_record_it_cannot_read() -> None:
    clock = lambda: parse_timestamp("2026-11-30T12:00:00Z")  # noqa: E731
    sweep = RedeliverySweep(GitHubClient(lambda: "jwt", clock=clock, sleep=lambda s: None), window=3600, clock=clock)
    responses.get(DELIVERIES, json=[_delivery_item(float("inf"))])
    responses.get(DELIVERIES, json=[_delivery_item(4, guid="guid-good")])
    attempt = responses.post(f"{DELIVERIES}/4/attempts", status=202, json={})
    stop = threading.Event()
    thread = threading.Thread(target=sweep.run, args=(stop, 0.001), daemon=True)
    thread.start()
    try:
        for _ in range(2000):  # until the second sweep asked, or the thread ended (bounded: no timing asserted)
            if attempt.call_count or not thread.is_alive():
                break
            time.sleep(0.005)
        assert thread.is_alive() and attempt.call_count == 1
    finally:
        stop.set()
        thread.join()
