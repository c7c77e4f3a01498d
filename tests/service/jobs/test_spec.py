"""JobSpec validation: the fields a hostile client controls are bounded and checked."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.service.config.reading import config_from_mapping
from runner.service.jobs.spec import SpecError, env_allowed, parse_submission
from tests.service.service_fakes import spec, spec_as_sent

CONFIG = config_from_mapping({"templates": ["base", "big"], "max_timeout_seconds": 600, "default_timeout_seconds": 60})


def test_full_spec() -> None:
    job = spec_as_sent(spec("pytest -q", ref="refs/pull/1/merge", event="pull_request_target", run_id=9,
                          run_attempt=2, working_directory="pkg/sub", env={"GITHUB_REF": "x", "CI": "1"},
                          artifacts=["report.xml", "dist/*.whl"], timeout_seconds=30, template="big",
                          policy="version: 1\n"), CONFIG)
    assert job.workdir == "/workspace/pkg/sub"
    assert job.artifacts == ("report.xml", "dist/*.whl")
    assert (job.run_id, job.run_attempt, job.timeout_seconds, job.template) == (9, 2, 30, "big")


def test_defaults() -> None:
    job = spec_as_sent(spec(), CONFIG)
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
    ({"template": "Not a name"}, "template: 'Not a name' is not a template name"),
    ({"run_attempt": 0}, "run_attempt"),
    ({"surprise": 1}, "surprise: unknown field"),
])
def test_invalid_specs(fields: dict, message: str) -> None:
    with pytest.raises(SpecError) as err:
        spec_as_sent(spec(**fields), CONFIG)
    assert message in str(err.value)


def test_a_template_is_the_services_for_every_repository_or_offered_by_the_repositorys_store_file() -> None:
    submitted = parse_submission(spec(template="node20"), CONFIG)
    with pytest.raises(SpecError, match=r"template: 'node20' is not offered here to o/r: the service offers base, big "
                                        r"to every repository, and o/r's store file offers go123; .*templates: \[node20\]"):
        submitted.check_template("o/r", ("go123",))
    submitted.check_template("o/r", ("go123", "node20"))
    parse_submission(spec(template="big"), CONFIG).check_template("o/r", ())


def test_not_an_object() -> None:
    with pytest.raises(SpecError, match="JSON object"):
        spec_as_sent(["a"], CONFIG)


@pytest.mark.parametrize("name, allowed", [("CI", True), ("GITHUB_SHA", True), ("RUNNER_OS", True),
                                           ("GITHUB_TOKEN", False), ("ACTIONS_RUNTIME_TOKEN", False),
                                           ("RUNNER_SECRET", False), ("GITHUB_API_KEY", False), ("PATH", False)])
def test_env_allowlist_and_denylist(name: str, allowed: bool) -> None:
    assert env_allowed(name, ("CI", "GITHUB_*", "RUNNER_*")) is allowed


@pytest.mark.parametrize("name", ["github_token", "Github_Token", "actions_runtime_token", "npm_Secret",
                                  "db_password", "aws_credentials", "deploy_key"])
def test_the_denylist_ignores_case_even_when_the_allowlist_admits_the_name(name: str) -> None:
    """Variable names are case-sensitive, so `github_token` is another variable, but one a workflow
    may well fill with the token: an operator's `*` or lower-case pattern must not let it through."""
    assert env_allowed(name, ("*",)) is False
    assert env_allowed(name, (name,)) is False
    with pytest.raises(SpecError, match=f"^env.{name}: not forwarded to the guest; the service allows \\*"):
        spec_as_sent(spec(env={name: "x"}), config_from_mapping({"templates": ["base"], "env_allowlist": ["*"]}))


@pytest.mark.parametrize("fields, message", [
    ({"run_id": 2**63}, "run_id: must be between 0 and 9223372036854775807, got 9223372036854775808"),
    ({"run_attempt": 2**63}, "run_attempt: must be between 1 and 9223372036854775807"),
    ({"run_id": -1}, "run_id: must be between 0"),
    ({"run_id": 10**400}, "run_id: must be between 0 and 9223372036854775807, got an integer of 1329 bits"),
    ({"run_id": 1.5}, "run_id: expected an integer, got 1.5"),
    ({"run_id": float("inf")}, "run_id: expected an integer, got inf"),
    ({"command": "\ud800"}, "command: not valid Unicode text (a lone surrogate at character 0)"),
    ({"command": "echo \x00"}, "command: contains a NUL byte"),
    ({"env": {"CI": "\ud800"}}, "env.CI: not valid Unicode text"),
    ({"env": {"CI": "a\x00b"}}, "env.CI: contains a NUL byte"),
    ({"env": {"CI\n": "x"}}, "env: 'CI\\n' is not a valid variable name"),
    ({"env": []}, "env: expected a mapping"),
    ({"job_name": "\udfff"}, "job_name: not valid Unicode text"),
    ({"working_directory": "sub/\ud800"}, "working_directory: not valid Unicode text"),
    ({"artifacts": ["dist/\udc80.whl"]}, "artifacts[0]: not valid Unicode text"),
    ({"artifacts": ["a" * 5000]}, "artifacts[0]: longer than 4096 bytes"),
    ({"artifacts": ""}, "artifacts: expected a list"),
    ({"sha": "a" * 40 + "\n"}, "sha: expected a lowercase hex commit id"),
    ({"repository": "octo/hello\n"}, "repository: expected owner/name"),
    ({"repository": "../.."}, "repository: expected owner/name"),
    ({"repository": "octo/."}, "repository: expected owner/name"),
    ({"x" * 10_000: 1}, "unknown field"),
])
def test_out_of_range_and_malformed_text_are_spec_errors(fields: dict, message: str) -> None:
    """Each of these used to pass validation and fail later, in SQLite or an encoder, as a 500."""
    with pytest.raises(SpecError, match=re.escape(message)) as err:
        spec_as_sent(spec(**fields), CONFIG)
    assert len(str(err.value)) < 300  # the message never echoes the whole value back


def test_the_largest_sqlite_integer_is_a_valid_run_id() -> None:
    job = spec_as_sent(spec(run_id=2**63 - 1, run_attempt=2**63 - 1), CONFIG)
    assert (job.run_id, job.run_attempt) == (2**63 - 1, 2**63 - 1)


# Lone surrogates are what json.loads gives for "\ud800"; hypothesis rarely draws them, so they are mixed in
# by hand, with NUL, a newline and path pieces, and the integers on either side of SQLite's range.
any_text = st.text(st.characters(codec=None) | st.sampled_from(["\ud800", "\udfff", "\x00", "\n", "/", "."]),
                   max_size=20)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 2**64])
    | st.floats() | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
VALID = {"repository": "octo/hello", "sha": spec()["sha"], "command": "true", "job_name": "test", "runner_name": "r1",
         "ref": "refs/pull/1/merge", "event": "pull_request", "run_id": 9, "run_attempt": 1,
         "working_directory": "pkg", "env": {"CI": "1"}, "artifacts": ["dist/*.whl"], "timeout_seconds": 30,
         "template": "big", "policy": "version: 1\n"}


def _near(value):
    """Values of the same shape as a valid one, with hostile text or out-of-range numbers inside."""
    if isinstance(value, str):
        return st.builds(lambda text, at: value[:at] + text + value[at:], any_text, st.integers(0, len(value)))
    if isinstance(value, int):
        return st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64, 10**30, 1.0, float("inf"), float("nan")])
    if isinstance(value, dict):
        return st.dictionaries(st.sampled_from(["CI", "GITHUB_SHA"]) | any_text, any_text | json_values, max_size=3)
    return st.lists(any_text | json_values, max_size=3)


# Each field is left out, valid, near-valid or any JSON, so the hostile value often reaches its own check
# instead of the spec failing at an earlier field.
spec_dicts = st.fixed_dictionaries({}, optional={
    **{key: st.just(value) | _near(value) | json_values for key, value in VALID.items()}, "x": json_values})


@settings(max_examples=300, deadline=None, derandomize=True)
@given(spec_dicts)
def test_any_json_is_a_spec_or_a_spec_error(data: dict) -> None:
    try:
        job = spec_as_sent({**spec(), **data}, CONFIG)
    except SpecError:
        return
    assert job.workdir.startswith("/workspace")
    assert ".." not in job.workdir.split("/")
    assert all(not g.startswith("/") and ".." not in g.split("/") for g in job.artifacts)
    # what the service stores and sends to the guest: UTF-8 text and integers SQLite takes
    texts = [job.repository, job.sha, job.command, job.job_name, job.runner_name, job.ref, job.event,
             job.working_directory, job.template, job.policy or "", *job.env, *job.env.values(), *job.artifacts]
    assert all(isinstance(t, str) and t.encode() for t in texts if t)
    assert all(i is None or 0 <= i < 2**63 for i in (job.run_id, job.run_attempt))
