"""Inputs and the JobSpec, built from real webhook payloads as GITHUB_EVENT_PATH."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from action.inputs import job_spec, read_inputs
from runner.errors import UserError
from runner.service.config import ServiceConfig
from tests.service.service_fakes import spec_as_sent

FORK = "webhooks/real-captured/listendev-lstn.pull_request.opened.from-fork.json"
SAME_REPO = "webhooks/octokit-webhooks-payload-examples/pull_request/synchronize.payload.json"


def environ(external: Path, payload: str | None, **more: str) -> dict[str, str]:
    env = {"INPUT_RUN": "pytest -q", "GITHUB_REPOSITORY": "octo/repo", "GITHUB_SHA": "a" * 40,
           "GITHUB_REF": "refs/pull/7/merge", "GITHUB_EVENT_NAME": "pull_request", "GITHUB_RUN_ID": "99",
           "GITHUB_RUN_ATTEMPT": "2", "GITHUB_JOB": "check"}
    if payload:
        env["GITHUB_EVENT_PATH"] = str(external / payload)
    env.update(more)
    return env


@pytest.mark.parametrize("payload", [FORK, SAME_REPO])
def test_spec_uses_the_pull_request_head_sha_and_passes_the_services_validation(
        external: Path, tmp_path: Path, payload: str) -> None:
    env = environ(external, payload, INPUT_ARTIFACTS="report.xml\n dist/*.whl \n", INPUT_TIMEOUT_MINUTES="1.5")
    spec = job_spec(read_inputs(env), env, tmp_path)
    head = json.loads((external / payload).read_text())["pull_request"]["head"]["sha"]
    assert spec.sha == head != env["GITHUB_SHA"]
    assert (spec.run_id, spec.run_attempt, spec.timeout_seconds) == (99, 2, 90)
    assert spec.artifacts == ("report.xml", "dist/*.whl")
    parsed = spec_as_sent(spec.to_wire(), ServiceConfig())
    assert parsed.sha == head and parsed.command == "pytest -q"


def test_push_event_uses_github_sha(external: Path, tmp_path: Path) -> None:
    env = environ(external, None, GITHUB_EVENT_NAME="push")
    assert job_spec(read_inputs(env), env, tmp_path).sha == "a" * 40


def test_only_named_variables_enter_the_spec(external: Path, tmp_path: Path) -> None:
    env = environ(external, FORK, INPUT_ENV="CI, GITHUB_RUN_ID\nFOO", FOO="bar", CI="true", HOST_SECRET="x")
    spec = job_spec(read_inputs(env), env, tmp_path)
    assert spec.env == {"CI": "true", "GITHUB_RUN_ID": "99", "FOO": "bar"}


@pytest.mark.parametrize("name", ["GITHUB_TOKEN", "github_token", "Github_Token", "ACTIONS_RUNTIME_TOKEN",
                                  "actions_id_token_request_url"])
def test_runner_credentials_are_refused(external: Path, name: str) -> None:
    with pytest.raises(UserError, match=name):
        read_inputs(environ(external, None, INPUT_ENV=name))


def test_a_named_variable_that_is_not_set_is_an_error(external: Path, tmp_path: Path) -> None:
    env = environ(external, None, INPUT_ENV="NOPE")
    with pytest.raises(UserError, match="NOPE"):
        job_spec(read_inputs(env), env, tmp_path)


@pytest.mark.parametrize("key,value,message", [
    ("INPUT_RUN", "  ", "'run' is required"),
    ("INPUT_WORKING_DIRECTORY", "../up", "working-directory"),
    ("INPUT_WORKING_DIRECTORY", "/abs", "working-directory"),
    ("INPUT_TIMEOUT_MINUTES", "soon", "timeout-minutes"),
    ("INPUT_TIMEOUT_MINUTES", "0", "timeout-minutes"),
    ("INPUT_TEMPLATE", "../x", "template"),
    ("INPUT_INCLUDE_GIT", "maybe", "include-git"),
    ("INPUT_ARTIFACTS", "../etc/passwd", "artifacts"),
    ("INPUT_ENV", "BAD-NAME", "env"),
])
def test_bad_inputs_name_the_input(external: Path, key: str, value: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        read_inputs(environ(external, None, **{key: value}))


def test_policy_inline_or_from_a_file_inside_the_checkout(external: Path, tmp_path: Path) -> None:
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "policy.yml").write_text("egress: []\n")
    env = environ(external, None, INPUT_POLICY="ci/policy.yml")
    assert job_spec(read_inputs(env), env, tmp_path).policy == "egress: []\n"
    env = environ(external, None, INPUT_POLICY="egress:\n  - host: pypi.org\n")
    assert job_spec(read_inputs(env), env, tmp_path).policy.startswith("egress:")


def test_policy_file_linking_out_of_the_checkout_is_refused(external: Path, tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "secret.yml").write_text("host-secret\n")
    (tmp_path / "ws" / "policy.yml").symlink_to(tmp_path / "secret.yml")
    env = environ(external, None, INPUT_POLICY="policy.yml")
    with pytest.raises(UserError, match="policy"):
        job_spec(read_inputs(env), env, tmp_path / "ws")


def test_a_deeply_nested_services_input_is_a_user_error(external: Path) -> None:
    """PyYAML recurses per nesting level: 20 000 of them, within the size cap, are a clear error, not a traceback."""
    with pytest.raises(UserError, match="input 'services' is nested too deeply"):
        read_inputs(environ(external, None, INPUT_SERVICES="[" * 20000 + "]" * 20000))
