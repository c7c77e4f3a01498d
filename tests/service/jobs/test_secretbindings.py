"""The operator's secret bindings file (issue 35): every problem at its file:line, values only from
root-only files, never quoted, and a repository gets only the bindings that name it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.errors import ConfigError
from runner.service.jobs.secretbindings import load_secrets

VALUE = "s3cret-Value-1234"


def write(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    secret = tmp_path / "value"
    secret.write_text(VALUE + "\n")
    secret.chmod(mode)
    path = tmp_path / "bindings.yml"
    path.write_text(text)
    return path


GOOD = """\
bindings:
  - name: index
    repositories: [Octo/Hello]
    env: INDEX_PASSWORD
    host: idx.test
    paths: ["/simple/*"]
    scheme: basic
    user: ci
    value_file: value
"""


def test_a_repository_gets_the_bindings_naming_it_each_job_a_placeholder_of_its_own(tmp_path: Path) -> None:
    secrets = load_secrets(write(tmp_path, GOOD))
    first, second = secrets.for_repository("octo/hello"), secrets.for_repository("OCTO/HELLO")
    assert [bound.binding.name for bound in first] == ["index"] and first[0].value == VALUE
    assert first[0].placeholder != second[0].placeholder and VALUE not in repr(secrets) + repr(first)
    assert secrets.for_repository("octo/other") == ()


@pytest.mark.parametrize(("text", "mode", "message"), [
    (GOOD, 0o644, "bindings.yml:9:17: value_file of 'index': .* only root may read"),
    (GOOD.replace("host: idx.test", "host: '*.idx.test'"), 0o600, "bindings.yml:2:5: .*no wildcard"),
    (GOOD.replace("    scheme: basic\n", ""), 0o600, "bindings.yml:2:5: .*basic needs a user"),
    (GOOD.replace("paths", "path"), 0o600, "bindings.yml:6:5: unknown key 'path'"),
    (GOOD + GOOD.removeprefix("bindings:\n"), 0o600, "given twice"),
])
def test_a_bad_file_says_where_and_what_to_fix_and_never_quotes_a_value(tmp_path, text, mode, message) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        load_secrets(write(tmp_path, text, mode))
    assert VALUE not in str(refused.value)
