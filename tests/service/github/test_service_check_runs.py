"""A job's check run from the service: the repository's `checks:` setting in the trusted store decides, the
VM's start creates it in progress, the job's end completes it with the service's own account (the signed
record's digests, JUnit totals counted from the artifacts, annotations from failures and `::error` lines),
each request checked against GitHub's check-runs fragments."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import responses

from policy import PolicyStore
from runner.github.checks import CheckRuns
from runner.github.client import GitHubClient, RetryPolicy
from runner.markdown import cell
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.github.checkruns import CheckRunReporter
from runner.service.jobs.service import JobService
from tests import reference
from tests.github.github_fakes import API, assert_valid_request, example, load_operations
from tests.jobapi.test_restored_from import image_manifest
from tests.service.service_fakes import SHA, checkout_tar, member, spec, tar_of

CREATE = ("POST_repos_owner_repo_check-runs.json", "/repos/{owner}/{repo}/check-runs", "post")
UPDATE = ("PATCH_repos_owner_repo_check-runs_check_run_id.json", "/repos/{owner}/{repo}/check-runs/{check_run_id}",
          "patch")
ONCE = RetryPolicy(attempts=1)  # an outage is an outage at once: no back-off in a test
JUNIT = (b'<testsuite name="s"><testcase classname="t" name="ok"/><testcase classname="t" name="bad">'
         b'<failure message="boom">tests/test_t.py:9: AssertionError</failure></testcase></testsuite>')


def _service(make_service: Callable[..., JobService], tmp_path: Path, setting: str) -> JobService:
    store = tmp_path / "store"
    (store / "octo").mkdir(parents=True)
    (store / "octo" / "hello.yml").write_text(f"version: 1\nallow: []\nchecks: {setting}\n")
    service = make_service(policy_dir=str(store))
    service.check_runs = CheckRunReporter(lambda: CheckRuns(GitHubClient(lambda: "ghs_token", retry=ONCE)), PolicyStore(store),
                                          "https://ci.example.org", service.attestor.key.keyid)
    return service


def _run(service: JobService, command: str, **fields: object) -> str:
    record = service.submit(spec(command, artifacts=["out"], **fields))
    service.put_checkout(record.id, [checkout_tar()])
    for _ in service.log_of(record.id).follow():
        pass
    assert service.check_runs is not None
    service.check_runs.close()  # what is queued goes out
    return record.id


@pytest.fixture
def github():
    operations = load_operations()
    created = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201",
                      "application/json:example-of-in-progress-conclusion")
    with responses.RequestsMock() as mock:
        mock.post(f"{API}/repos/octo/hello/check-runs", json=created, status=201)
        mock.patch(f"{API}/repos/octo/hello/check-runs/{created['id']}",
                   json=example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200"))
        yield mock


def test_the_check_run_carries_the_signed_records_digests(make_service, engine: FakeSandboxes, tmp_path, github) -> None:
    engine.programs["suite"] = prints(b"::error file=src/app.py,line=4,title=lint::unused import\n1 passed, 1 failed\n", 1)
    engine.artifacts_tar = tar_of([(member("out/report.xml"), JUNIT)])
    engine.manifest = image_manifest()
    service = _service(make_service, tmp_path, "on")
    job = _run(service, "suite")
    start = assert_valid_request(github.calls[0].request.body, *CREATE)
    assert (start["head_sha"], start["status"], start["external_id"]) == (SHA, "in_progress", job)
    assert start["details_url"] == f"https://ci.example.org/ui/jobs/{job}" and start["name"] == "microvm-check / test"
    end = assert_valid_request(github.calls[1].request.body, *UPDATE)
    assert (end["status"], end["conclusion"]) == ("completed", "failure")
    assert [(a["path"], a["start_line"], a["annotation_level"]) for a in end["output"]["annotations"]] == [
        ("tests/test_t.py", 9, "failure"), ("src/app.py", 4, "failure")]
    summary = end["output"]["summary"].replace("&#58;", ":")
    assert "1 passed, 1 failed, 0 skipped" in summary
    statement = json.loads(base64.b64decode(json.loads(
        (service.config.jobs_dir / job / "attestation.intoto.jsonl").read_text())["payload"]))
    for digest in (statement["predicate"]["policyDigest"], statement["predicate"]["egressAudit"]["digest"]["sha256"],
                   statement["subject"][0]["digest"]["sha256"], service.attestor.key.keyid):
        assert digest in summary
    assert "blocked.example" in summary and "```yaml" in summary  # the fake guest's refused egress and its snippet
    restored = service.get(job).restored_from
    assert restored is not None and restored.image is not None
    row = f"| restored from | {cell(restored.describe(), 600)} |"  # the record's one value, as the page shows it
    assert row in end["output"]["summary"] and restored.image.ref.rsplit(":", 1)[1] in row
    assert statement["predicate"]["image"] == {"ref": restored.image.ref, "digest": restored.image.digest}


@pytest.mark.parametrize("setting,fork,posts", [("off", True, 0), ("forks", False, 0), ("forks", True, 2)])
def test_the_repositorys_setting_decides(make_service, engine: FakeSandboxes, tmp_path, setting: str, fork: bool,
                                        posts: int) -> None:
    engine.programs["ok"] = prints(b"fine\n", 0)
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        created = example(load_operations(), "POST /repos/{owner}/{repo}/check-runs", "201")
        mock.post(f"{API}/repos/octo/hello/check-runs", json=created, status=201)
        mock.patch(f"{API}/repos/octo/hello/check-runs/{created['id']}", json=created)
        service = _service(make_service, tmp_path, setting)
        _run(service, "ok", fork=fork)
        assert len(mock.calls) == posts


def test_github_down_leaves_the_job_its_result(make_service, engine: FakeSandboxes, tmp_path) -> None:
    engine.programs["ok"] = prints(b"fine\n", 0)
    with responses.RequestsMock() as mock:
        mock.post(f"{API}/repos/octo/hello/check-runs", json={"message": "Server Error"}, status=500)
        service = _service(make_service, tmp_path, "on")
        job = _run(service, "ok")
    record = service.get(job)
    assert (record.state, record.exit_code) == ("finished", 0)


HOSTILE = "<img src=x onerror=alert(1)> [x](https://evil.example) ![i](https://evil.example/i.png) `c` | col"


def test_a_hostile_guests_text_arrives_inert(make_service, engine: FakeSandboxes, tmp_path, github) -> None:
    title = HOSTILE.replace("%", "%25").replace(":", "%3A").replace(",", "%2C")  # as a tool escapes a property
    escaped = HOSTILE.replace("&", "&amp;").replace("<", "&lt;").replace('"', "&quot;")
    report = (f'<testsuite name="{escaped}"><testcase classname="{escaped}" name="{escaped}" file="../../etc/passwd">'
              f'<failure message="{escaped}">::add-mask::x\n/etc/shadow:3: boom</failure></testcase></testsuite>')
    engine.programs["evil"] = prints(f"::error file=/etc/passwd,line=1::{HOSTILE}\n"
                                     f"::error file=src/ok.py,line=2,title={title}::{HOSTILE}\n".encode(), 1)
    engine.artifacts_tar = tar_of([(member(f"out/{'x' * 10}.xml"), report.encode())])
    service = _service(make_service, tmp_path, "on")
    _run(service, "evil")
    end = assert_valid_request(github.calls[1].request.body, *UPDATE)
    summary = end["output"]["summary"]
    for trick in ("<img", "](", "![", "`c`", "| col", "https://"):
        assert trick not in summary
    annotations = end["output"]["annotations"]
    assert [a["path"] for a in annotations] == ["src/ok.py"]  # no file outside the repository is named
    assert annotations[0]["title"] == HOSTILE and annotations[0]["message"] == HOSTILE  # plain text on GitHub


def _validation_failed() -> dict[str, object]:
    """GitHub's 422 body (the `validation-error` schema its fragments share), checked against that schema."""
    document = reference.fragment("post", "/app/installations/{installation_id}/access_tokens")
    body = {"message": "Invalid request.\n\nFor 'properties/summary', is not a valid string.",
            "documentation_url": "https://docs.github.com/rest/checks/runs#update-a-check-run"}
    jsonschema.validate(body, {**document["components"]["schemas"]["validation-error"],
                               "components": document["components"]})
    return body


def test_an_update_github_refuses_is_sent_again_short_and_the_check_run_ends(make_service, engine: FakeSandboxes,
                                                                             tmp_path) -> None:
    """GitHub answers 422 to the first update (a body it will not take): the service sends a short one with
    the conclusion and its own digests, and the check run ends completed instead of staying in progress."""
    engine.programs["evil"] = prints(b"::error file=src/app.py,line=4::bad\n" * 60, 1)
    operations = load_operations()
    created = example(operations, "POST /repos/{owner}/{repo}/check-runs", "201")
    path = f"{API}/repos/octo/hello/check-runs/{created['id']}"
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.post(f"{API}/repos/octo/hello/check-runs", json=created, status=201)
        mock.patch(path, json=_validation_failed(), status=422)
        mock.patch(path, json=example(operations, "PATCH /repos/{owner}/{repo}/check-runs/{check_run_id}", "200"))
        service = _service(make_service, tmp_path, "on")
        _run(service, "evil")
        updates = [assert_valid_request(call.request.body, *UPDATE) for call in mock.calls[1:]]
    assert [u.get("status") for u in updates] == [None, "completed"]  # the first of two batches, refused; the end
    end = updates[-1]
    assert (end["conclusion"], "annotations" in end["output"]) == ("failure", False)
    assert service.attestor.key.keyid in end["output"]["summary"]
