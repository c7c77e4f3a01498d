"""JobSpec validation: the fields a hostile client controls are bounded and checked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from service_fakes import spec

from runner.service.config import config_from_mapping
from runner.service.spec import JobSpec, SpecError, env_allowed, parse_spec

CONFIG = config_from_mapping({"templates": ["base", "big"], "max_timeout_seconds": 600, "default_timeout_seconds": 60})


def test_full_spec() -> None:
    job = parse_spec(spec("pytest -q", ref="refs/pull/1/merge", event="pull_request_target", run_id=9,
                          run_attempt=2, working_directory="pkg/sub", env={"GITHUB_REF": "x", "CI": "1"},
                          artifacts=["report.xml", "dist/*.whl"], timeout_seconds=30, template="big",
                          policy="version: 1\n"), CONFIG)
    assert job.workdir == "/workspace/pkg/sub"
    assert job.artifacts == ("report.xml", "dist/*.whl")
    assert (job.run_id, job.run_attempt, job.timeout_seconds, job.template) == (9, 2, 30, "big")


def test_defaults() -> None:
    job = parse_spec(spec(), CONFIG)
    assert (job.workdir, job.timeout_seconds, job.template, job.policy) == ("/workspace", 60, "base", None)


@pytest.mark.parametrize("fields, message", [
    ({"repository": "no-slash"}, "repository: expected owner/name"),
    ({"repository": "../../etc/x"}, "repository"),
    ({"sha": "HEAD"}, "sha: expected"),
    ({"command": "   "}, "command: must not be empty"),
    ({"command": "x" * 70000}, "command: longer than"),
    ({"command": 5}, "command: expected a string"),
    ({"working_directory": "../up"}, "working_directory: '..'"),
    ({"working_directory": "/etc"}, "working_directory: expected a relative path"),
    ({"artifacts": ["/etc/passwd"]}, "artifacts[0]: expected a relative path"),
    ({"artifacts": ["ok", "a/../../b"]}, "artifacts[1]: '..'"),
    ({"artifacts": "report.xml"}, "artifacts: expected a list"),
    ({"env": {"GITHUB_TOKEN": "ghs_x"}}, "env.GITHUB_TOKEN: not forwarded"),
    ({"env": {"HOME": "/root"}}, "env.HOME: not forwarded"),
    ({"env": {"1BAD": "x"}}, "not a valid variable name"),
    ({"env": {"CI": 1}}, "env.CI: expected a string"),
    ({"timeout_seconds": 601}, "timeout_seconds: must be between 1 and 600"),
    ({"timeout_seconds": True}, "timeout_seconds: expected an integer"),
    ({"template": "other"}, "template: 'other' is not offered here"),
    ({"run_attempt": 0}, "run_attempt"),
    ({"surprise": 1}, "surprise: unknown field"),
])
def test_invalid_specs(fields: dict, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec(**fields), CONFIG)
    assert message in str(err.value)


def test_not_an_object() -> None:
    with pytest.raises(SpecError, match="JSON object"):
        parse_spec(["a"], CONFIG)


@pytest.mark.parametrize("name, allowed", [("CI", True), ("GITHUB_SHA", True), ("RUNNER_OS", True),
                                           ("GITHUB_TOKEN", False), ("ACTIONS_RUNTIME_TOKEN", False),
                                           ("RUNNER_SECRET", False), ("GITHUB_API_KEY", False), ("PATH", False)])
def test_env_allowlist_and_denylist(name: str, allowed: bool) -> None:
    assert env_allowed(name, ("CI", "GITHUB_*", "RUNNER_*")) is allowed


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(JobSpec.__dataclass_fields__) + ["x"]), json_values, max_size=8))
def test_any_json_is_a_spec_or_a_spec_error(data: dict) -> None:
    try:
        job = parse_spec({**spec(), **data}, CONFIG)
    except SpecError:
        return
    assert job.workdir.startswith("/workspace")
    assert ".." not in job.workdir.split("/")
    assert all(not g.startswith("/") and ".." not in g.split("/") for g in job.artifacts)
