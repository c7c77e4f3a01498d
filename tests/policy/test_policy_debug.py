"""The `debug:` setting of a repository's trusted file (policy.warm, issue 37): how long the VM of a failed
job is kept for the operator. Only the trusted file has it: a job's policy and the org default refuse the
key, and the store reads it from its own file or the default branch's, never a pull request's."""

from __future__ import annotations

import pytest

from policy import PolicyError, PolicyStore, load_policy, load_repository_file


def _store(tmp_path, own: str | None) -> PolicyStore:
    if own is not None:
        (tmp_path / "acme").mkdir()
        (tmp_path / "acme" / "app.yml").write_text(own)
    return PolicyStore(tmp_path)


@pytest.mark.parametrize("text, seconds", [
    ("version: 1\n", None),
    ("version: 1\ndebug: true\n", 900),
    ("version: 1\ndebug: false\n", 0),
    ("version: 1\ndebug: {}\n", 900),
    ("version: 1\ndebug: {keep_seconds: 120}\n", 120),
    ("version: 1\ndebug: {keep_seconds: 0}\n", 0),
])
def test_the_debug_setting_reads(text: str, seconds: int | None) -> None:
    assert load_repository_file(text, "acme/app.yml").debug_seconds == seconds


@pytest.mark.parametrize("text, message", [
    ("version: 1\ndebug: 15m\n", r"acme/app.yml:2:8: debug must be true, false or a mapping \{keep_seconds: N\}"),
    ("version: 1\ndebug: {keep_seconds: -1}\n", r"acme/app.yml:2:23: debug.keep_seconds must be a whole number"),
    ("version: 1\ndebug: {keep_seconds: 86401}\n", r"acme/app.yml:2:23: debug.keep_seconds must be a whole number"),
    ("version: 1\ndebug: {keep_seconds: '60'}\n", r"acme/app.yml:2:23: debug.keep_seconds"),
    ("version: 1\ndebug: {keep_minutes: 5}\n", r"acme/app.yml:2:9: unknown key 'keep_minutes' in debug"),
])
def test_a_wrong_debug_setting_is_refused_where_it_is(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        load_repository_file(text, "acme/app.yml")


def test_a_jobs_policy_cannot_say_debug() -> None:
    with pytest.raises(PolicyError, match=r"job policy:2:1: unknown key 'debug' in the policy"):
        load_policy("version: 1\ndebug: true\n", "job policy")


def test_the_store_file_wins_over_the_default_branch_and_the_branch_file_is_read_without_one(tmp_path) -> None:
    branch = load_repository_file("version: 1\ndebug: {keep_seconds: 60}\n", "acme/app:.github/microvm-check.yml")
    assert _store(tmp_path, None).debug_for("acme/app", lambda: branch) == 60
    assert _store(tmp_path, None).debug_for("acme/app") is None
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "app.yml").write_text("version: 1\n")
    assert PolicyStore(tmp_path).debug_for("acme/app", lambda: branch) is None  # the store's file says nothing
