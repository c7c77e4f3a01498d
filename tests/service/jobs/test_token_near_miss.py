"""A token that is almost a good one opens nothing, for each of the service's four secrets: a job's token,
a runner's token, a `keep: job` session's token and a sandbox's token (runner/service/jobs/auth.py,
sessions.py, sandboxes.py keep their SHA-256 digests and look tokens up by them).

A forged token unlike any real one (`"x" * 43`) cannot tell a digest of the whole token from a digest
of its first characters; the near misses here can: the last character changed, one character
appended, and the first 8 characters kept with the rest another token's. Each test also shows the
real token opening what it should, so a refusal is not the test's own mistake.
"""

from __future__ import annotations

import secrets

import pytest

from runner.jobapi.contract import JobState
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.jobs.auth import OPERATOR, Caller, Forbidden, Kind, Unauthorized
from runner.service.jobs.sandboxes import Owner, SandboxRefused, SandboxRequest
from tests.service.jobs.test_sessions import Job
from tests.service.service_fakes import spec

PREFIX = 8  # a digest of only this many leading characters is what the near misses catch


def near_misses(token: str) -> list[str]:
    """Tokens a digest of the whole token tells from `token`, and a digest of a prefix does not."""
    last = "A" if token[-1] != "A" else "B"
    other = secrets.token_urlsafe(32)
    while other[0] == token[PREFIX]:
        other = secrets.token_urlsafe(32)
    shared_prefix = (token[:PREFIX] + other)[:len(token)]
    return [token[:-1] + last, token + "A", shared_prefix]


def test_near_misses_differ_from_the_token_but_share_its_first_characters() -> None:
    token = secrets.token_urlsafe(32)
    misses = near_misses(token)
    assert token not in misses and len(set(misses)) == 3
    assert all(miss[:PREFIX] == token[:PREFIX] for miss in misses)


def test_a_near_miss_of_a_job_token_reaches_nothing_of_the_job(make_service) -> None:
    service = make_service()
    record, token, _ = service.submit_as(OPERATOR, spec("true"))
    member = Caller(Kind.MEMBER, "uid 4242")
    service.access.require_job(member, record.id, token)  # the job's own token reaches it
    for miss in near_misses(token):
        with pytest.raises(Forbidden, match="a token that is not this job's"):
            service.access.require_job(member, record.id, miss)


def test_a_near_miss_of_a_runner_token_is_no_runner(make_host) -> None:
    host = make_host()
    token = secrets.token_urlsafe(32)
    host.desk.add_runner("mvc-near-1", token)
    assert host.service.access.tcp_caller(token).runner == "mvc-near-1"
    for miss in near_misses(token):
        with pytest.raises(Unauthorized, match="not one this service issued"):
            host.service.access.tcp_caller(miss)


def test_a_near_miss_of_a_session_token_neither_attaches_to_the_kept_vm_nor_ends_it(make_host,
                                                                                    engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    host = make_host()
    service = host.service
    first = Job(service)
    first.step("ok")
    kept = engine.created[0]
    real = first.token
    assert real is not None
    for miss in near_misses(real):
        other = Job(service)
        other.token = miss
        record = other.submit("ok", keep="none")
        assert record.state == JobState.AWAITING_CHECKOUT, miss  # a plain step: a VM of its own, after a checkout
        service.cancel(record.id)
    assert kept.alive and len(kept.exec_calls) == 1 and service.sessions.count() == 1
    last = first.step("ok", keep="none")  # the real token still attaches, and ends the session
    assert service.get(last).vm_id == kept.id and engine.alive() == []


def test_a_near_miss_of_a_sandbox_token_opens_no_sandbox(hosts) -> None:
    host = hosts(serve_api=False, sandboxes={"max_live": 2, "max_per_caller": 2})
    sandbox, token = host.sandboxes.create(Owner("uid 4242"), SandboxRequest.parse({}, host.config))
    assert host.sandboxes.find(sandbox.id, token) is sandbox
    for miss in near_misses(token):
        with pytest.raises(SandboxRefused, match="reached only with the token its create answered"):
            host.sandboxes.find(sandbox.id, miss)
