"""A workflow's own secret bindings (the action's `secrets:` input; issue 35), as the real service admits them.

A binding from the workflow is honoured only when the workflow is the repository's trusted one (the event its
runner's job-started hook reported, which the fork guard checked, runs the base branch's workflow file), only
for a host the repository's trusted policy (the operator's store file, not the job's own) names, and never in
place of, or wider than, an operator's binding. Every refusal says why; no answer, record, kept spec or
database row carries the value. The real service over its socket, with a registered runner's credential
(`microvm-check runner credential`, held to the repository) and no VM: nothing here gets a checkout.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import GitHubJob, JobStarted

REPOSITORY = "octo/hello"
NAME = "mvc-secrets-1"
VALUE = "wf-Value-" + "7c1d0e9a5b3f4a2c8d6e"
STORE = "version: 1\nallow:\n  - host: idx.test\n    ports: [8443]\n  - cidr: 198.51.100.0/24\n    ports: [443]\n"
OPERATOR = """\
bindings:
  - {name: index, repositories: [octo/hello], env: INDEX_PASSWORD, host: idx.test, ports: [8443],
     paths: ["/simple/*"], scheme: basic, user: ci, value_file: op.secret}
"""


def binding(**changes: Any) -> dict[str, Any]:
    return {"name": "npm", "env": "NPM_TOKEN", "host": "idx.test", "ports": [8443], "paths": ["/npm/*"],
            "scheme": "bearer", "value": VALUE, **changes}


def spec(run_id: int, secrets: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"repository": REPOSITORY, "sha": "f" * 40, "run_id": run_id, "run_attempt": 1, "job_name": "check",
            "command": "true", "secrets": secrets, **extra}


def started(run_id: int, event: str) -> JobStarted:
    """A job of `event`; a pull request's is a same-repository one (the guard lets it run without GitHub)."""
    pull = {"number": 7, "author_association": "MEMBER", "head": {"sha": "a" * 40, "repo": {"full_name": REPOSITORY}},
            "base": {"sha": "b" * 40, "repo": {"full_name": REPOSITORY}}} if event.startswith("pull_request") else None
    return JobStarted(GitHubJob(REPOSITORY, run_id, 1, "check"), f"{REPOSITORY}/.github/workflows/ci.yml@refs/heads/main",
                      event, {"event_name": event, "repository": REPOSITORY, "workflow_ref": "", "pull_request": pull})


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mvc-wfsec-", dir="/run"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextmanager
def service(root: Path) -> Iterator[tuple[Any, str]]:
    from runner.cli import main
    from runner.service.config.reading import load_config
    from runner.service.host.assembly import ServiceHost

    (root / "policies" / "octo").mkdir(parents=True)
    (root / "policies" / "octo" / "hello.yml").write_text(STORE)
    (root / "op.secret").write_text("operator-Value-0123456789\n")
    (root / "op.secret").chmod(0o600)
    (root / "secrets.yml").write_text(OPERATOR)
    path = root / "service.yml"
    path.write_text(yaml.safe_dump({"socket": str(root / "api.sock"), "state_dir": str(root / "state"),
                                    "policy_dir": str(root / "policies"), "secrets": str(root / "secrets.yml"),
                                    "network": {"enabled": True, "slots": 1}}))
    (root / "runner").mkdir()
    assert main(["runner", "credential", "--runner-dir", str(root / "runner"), "--name", NAME, "--hooks-dir",
                 str(root / "hooks"), "--service-config", str(path), "--repository", REPOSITORY]) == 0
    token = next(line.split("=", 1)[1] for line in (root / "runner" / ".env").read_text().splitlines()
                 if line.startswith("MICROVM_CHECK_RUNNER_TOKEN="))

    def no_vms(request: Any) -> Any:
        raise AssertionError("no job here gets a checkout: no VM may be created")

    with ServiceHost(load_config(path), sandboxes=no_vms, origin=str(path)) as host:
        yield host, token


def submit_as_runner(host: Any, token: str, run_id: int, event: str, body: dict[str, Any]) -> tuple[int, str]:
    """The runner's job-started hook reports a job of `event`, then a step submits `body`: (status, error).
    One report per service: a registered runner takes one job at a time."""
    with JobClient(socket=host.config.socket, runner_token=token, retry_statuses=frozenset()) as client:
        assert client.job_started(started(run_id, event)).allowed
        try:
            client.submit(body)
            return 201, ""
        except JobAPIError as exc:
            return exc.status or 0, str(exc)


def test_a_trusted_workflows_binding_is_honoured_and_its_value_is_kept_nowhere(root: Path) -> None:
    with service(root) as (host, token):
        status, error = submit_as_runner(host, token, 1, "pull_request_target", spec(1, [binding()]))
        assert status == 201, error
        (record,) = host.service.list(limit=5)
        run = host.service.runs.get(record.id)
        kept = (repr(run), repr(run.spec), str(run.spec.to_wire()), str(record.to_wire()))
        names = [(bound.binding.name, bound.binding.env, bound.value == VALUE) for bound in run.secrets.bound]
        sources = dict(run.secrets.sources)
        host.service.drain()
    assert status == 201, error
    assert names == [("index", "INDEX_PASSWORD", False), ("npm", "NPM_TOKEN", True)]
    assert sources == {"index": "operator", "npm": "workflow"}
    assert run.spec.secrets == ()
    for text in kept:
        assert VALUE not in text
    for path in (root / "state").rglob("*"):
        if path.is_file():
            assert VALUE.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("event", ["pull_request", "pull_request_review", "issue_comment", "discussion"])
def test_a_workflow_the_pull_request_may_have_written_binds_nothing_and_is_told_so(root: Path, event: str) -> None:
    with service(root) as (host, token):
        status, error = submit_as_runner(host, token, 2, event, spec(2, [binding()]))
        jobs = host.service.list(limit=5)
    assert status == 403, error
    assert "the action's secrets: input (npm) is not honoured" in error and "pull_request_target" in error, error
    assert jobs == [] and VALUE not in error


def test_a_report_whose_event_is_not_the_one_the_guard_checks_binds_no_job(root: Path) -> None:
    """The service trusts a workflow's bindings by the event it keeps of the report: it must be the one the
    fork guard checked, or a report could say pull_request_target while the guard looked at pull_request."""
    forged = started(4, "pull_request")
    forged = JobStarted(forged.job, forged.workflow_ref, "pull_request_target", forged.guard)
    with service(root) as (host, token), JobClient(socket=host.config.socket, runner_token=token,
                                                   retry_statuses=frozenset()) as client:
        verdict = client.job_started(forged)
        with pytest.raises(JobAPIError) as refused:
            client.submit(spec(4, [binding()]))
    assert not verdict.allowed and "the report's event and the event the guard is to check differ" in verdict.reasons[0]
    assert refused.value.status == 403 and "which the fork guard did not let run" in str(refused.value)


@pytest.mark.parametrize(("changes", "extra", "message"), [
    ({"host": "other.test"}, {}, "other.test on port(s) 8443 is not allowed by a host: rule"),
    # the job's own policy (the pull request's) cannot add the host: only the trusted policy counts
    ({"host": "other.test"}, {"policy": STORE.replace("idx.test", "other.test")},
     "other.test on port(s) 8443 is not allowed by a host: rule"),
    ({"ports": [443]}, {}, "idx.test on port(s) 443 is not allowed"),
    ({"host": "198.51.100.7", "ports": [443]}, {}, "is not allowed by a host: rule"),
    ({"name": "index", "paths": ["/*"]}, {}, "the operator's binding 'index' has this name or variable"),
    ({"env": "INDEX_PASSWORD", "paths": ["/*"]}, {}, "the operator's binding 'index' has this name or variable"),
    ({"value": "short"}, {}, "its value cannot be bound: a value must have 8 to 4096 characters"),
    ({"value": VALUE + " x"}, {}, "its value cannot be bound: a value must be visible ASCII"),
    ({"host": "*.idx.test"}, {}, "must be one exact lower-case name"),
    ({"paths": "/npm/*"}, {}, "secrets.npm.paths: expected a list"),
])
def test_a_binding_that_would_widen_what_the_operator_allows_is_refused_with_why(
        root: Path, changes: dict[str, Any], extra: dict[str, Any], message: str) -> None:
    with service(root) as (host, token):
        status, error = submit_as_runner(host, token, 3, "pull_request_target", spec(3, [binding(**changes)], **extra))
        jobs = host.service.list(limit=5)
    assert status == 400 and message in error, (status, error)
    assert jobs == [] and VALUE not in error


def test_config_check_reads_the_bindings_file_as_serve_does(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runner.cli import main

    (root / "op.secret").write_text("operator-Value-0123456789\n")
    (root / "op.secret").chmod(0o600)
    (root / "secrets.yml").write_text(OPERATOR)
    config = root / "service.yml"
    config.write_text(f"socket: {root}/api.sock\nsecrets: secrets.yml\n")
    assert main(["config", "check", str(config)]) == 0
    assert f"secret bindings: 1 in {root}/secrets.yml (index)" in capsys.readouterr().out
    (root / "op.secret").chmod(0o644)
    (root / "secrets.yml").write_text(OPERATOR.replace("paths:", "path:"))
    assert main(["config", "check", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"{root}/secrets.yml:3:6: unknown key 'path' in a binding; did you mean 'paths'?" in err, err
    (root / "secrets.yml").write_text(OPERATOR)
    assert main(["config", "check", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"{root}/secrets.yml:3:" in err and "only root may read" in err and "operator-Value" not in err, err
