"""Inputs and the JobSpec, built from real webhook payloads as GITHUB_EVENT_PATH."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from action.inputs import job_spec, read_inputs
from runner.errors import UserError
from runner.service.config.settings import ServiceConfig
from tests.reference import CAPTURED, captured_path, payload
from tests.service.service_fakes import spec_as_sent

FORK = "listendev-lstn.pull_request.opened.from-fork.json"  # captured (tests/reference.py)
SAME_REPO = "synchronize.payload.json"  # octokit's example


def event_file(tmp_path: Path, name: str) -> Path:
    """The stored payload as the runner hands it over: a file (the captured one where shared/external/ has it)."""
    if name in CAPTURED:
        return captured_path(name)
    path = tmp_path / "event.json"
    path.write_text(json.dumps(payload(name)))
    return path


def environ(event: Path | None, **more: str) -> dict[str, str]:
    env = {"INPUT_RUN": "pytest -q", "GITHUB_REPOSITORY": "octo/repo", "GITHUB_SHA": "a" * 40,
           "GITHUB_REF": "refs/pull/7/merge", "GITHUB_EVENT_NAME": "pull_request", "GITHUB_RUN_ID": "99",
           "GITHUB_RUN_ATTEMPT": "2", "GITHUB_JOB": "check"}
    if event:
        env["GITHUB_EVENT_PATH"] = str(event)
    env.update(more)
    return env


@pytest.mark.parametrize("name", [FORK, SAME_REPO])
def test_spec_uses_the_pull_request_head_sha_and_passes_the_services_validation(tmp_path: Path, name: str) -> None:
    event = event_file(tmp_path, name)
    env = environ(event, INPUT_ARTIFACTS="report.xml\n dist/*.whl \n", INPUT_TIMEOUT_MINUTES="1.5")
    spec = job_spec(read_inputs(env), env, tmp_path)
    head = json.loads(event.read_text())["pull_request"]["head"]["sha"]
    assert spec.sha == head != env["GITHUB_SHA"]
    assert (spec.run_id, spec.run_attempt, spec.timeout_seconds) == (99, 2, 90)
    assert spec.artifacts == ("report.xml", "dist/*.whl")
    parsed = spec_as_sent(spec.to_wire(), ServiceConfig())
    assert parsed.sha == head and parsed.command == "pytest -q"


def test_push_event_uses_github_sha(tmp_path: Path) -> None:
    env = environ(None, GITHUB_EVENT_NAME="push")
    assert job_spec(read_inputs(env), env, tmp_path).sha == "a" * 40


def test_only_named_variables_enter_the_spec(tmp_path: Path) -> None:
    env = environ(event_file(tmp_path, SAME_REPO), INPUT_ENV="CI, GITHUB_RUN_ID\nFOO", FOO="bar", CI="true", HOST_SECRET="x")
    spec = job_spec(read_inputs(env), env, tmp_path)
    assert spec.env == {"CI": "true", "GITHUB_RUN_ID": "99", "FOO": "bar"}


@pytest.mark.parametrize("name", ["GITHUB_TOKEN", "github_token", "Github_Token", "ACTIONS_RUNTIME_TOKEN",
                                  "actions_id_token_request_url"])
def test_runner_credentials_are_refused(name: str) -> None:
    with pytest.raises(UserError, match=name):
        read_inputs(environ(None, INPUT_ENV=name))


def test_a_named_variable_that_is_not_set_is_an_error(tmp_path: Path) -> None:
    env = environ(None, INPUT_ENV="NOPE")
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
def test_bad_inputs_name_the_input(key: str, value: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        read_inputs(environ(None, **{key: value}))


def test_policy_inline_or_from_a_file_inside_the_checkout(tmp_path: Path) -> None:
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "policy.yml").write_text("egress: []\n")
    env = environ(None, INPUT_POLICY="ci/policy.yml")
    assert job_spec(read_inputs(env), env, tmp_path).policy == "egress: []\n"
    env = environ(None, INPUT_POLICY="egress:\n  - host: pypi.org\n")
    assert job_spec(read_inputs(env), env, tmp_path).policy.startswith("egress:")


def test_policy_file_linking_out_of_the_checkout_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "secret.yml").write_text("host-secret\n")
    (tmp_path / "ws" / "policy.yml").symlink_to(tmp_path / "secret.yml")
    env = environ(None, INPUT_POLICY="policy.yml")
    with pytest.raises(UserError, match="policy"):
        job_spec(read_inputs(env), env, tmp_path / "ws")


def test_a_deeply_nested_services_input_is_a_user_error() -> None:
    """PyYAML recurses per nesting level: 20 000 of them, within the size cap, are a clear error, not a traceback."""
    with pytest.raises(UserError, match="input 'services' is nested too deeply"):
        read_inputs(environ(None, INPUT_SERVICES="[" * 20000 + "]" * 20000))


@pytest.mark.parametrize("value, refused", [("", False), ("false", False), ("true", True), ("15m", True)])
def test_the_debug_input_keeps_nothing_and_says_why(value: str, refused: bool) -> None:
    from action.inputs import debug_refusal
    from runner.jobapi.contract import JobSpec

    why = debug_refusal({"INPUT_DEBUG": value})
    assert (why is not None) == refused
    if why:
        assert "never keeps a VM" in why and "trusted file" in why and "docs/debugging.md" in why
    assert "debug" not in JobSpec.__dataclass_fields__, "the spec a workflow sends carries no debug setting"
