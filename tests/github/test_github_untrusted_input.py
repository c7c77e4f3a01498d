"""Arbitrary JSON where a webhook payload or an event file is expected: parsed or refused, never a crash."""

from __future__ import annotations

import json

from github_fakes import load_payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.github import guard, jobs

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
