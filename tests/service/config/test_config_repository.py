"""The repository names a config makes jobs and sandboxes run as are checked by the job API contract's one
pattern (issue 40, item 10): `sandboxes.repository: ../..` or `local_jobs.repository: ../x` used to load,
and the service then refused every sandbox create or member submit with a 400 that blamed the caller.
Now `config check` and `serve` refuse the file, with its file:line and what to write instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from runner.cli import main
from runner.jobapi.contract import REPOSITORY
from runner.service.config.reading import ConfigError, load_config
from runner.service.config.schema import schema_text

BAD = ["../..", "../x", "x/..", "./x", "x/.", "a b/c", "a/b/c", "a/b\n", "a\\b/c", "é/x", "x/" + "a" * 101, "/x", "x/"]
GOOD = ["my-org/my-repo", "sandbox/sandbox", "A.b/c_d-1", "..a/b", "a/...", "x/" + "a" * 100]
BAD_FILE = "state_dir: state\nsandboxes:\n  repository: ../..\nlocal_jobs:\n  repository: ../x\n"
WHAT_TO_WRITE = "is not a repository name; write owner/name: each part 1 to 100 letters, digits"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "service.yml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("section", ["sandboxes", "local_jobs"])
@pytest.mark.parametrize("name", BAD)
def test_a_name_the_contract_refuses_is_refused_with_its_line(tmp_path: Path, section: str, name: str) -> None:
    path = write(tmp_path, f"{section}:\n  repository: {json.dumps(name)}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    [problem] = str(err.value).splitlines()
    assert problem.startswith(f"{path}:2:15: {section}.repository: ") and WHAT_TO_WRITE in problem, problem
    assert not REPOSITORY.fullmatch(name)  # the contract refuses it too: a submit or create would have


@pytest.mark.parametrize("name", GOOD)
def test_a_name_the_contract_takes_is_taken(tmp_path: Path, name: str) -> None:
    config = load_config(write(tmp_path, f"sandboxes: {{repository: {name}}}\nlocal_jobs: {{repository: {name}}}\n"))
    assert config.sandboxes.repository == config.local_jobs.repository == name
    assert REPOSITORY.fullmatch(name)


def test_the_published_schema_takes_exactly_what_the_loader_takes() -> None:
    schema = json.loads(schema_text())
    for section in ("sandboxes", "local_jobs"):
        for name in BAD + GOOD:
            document = {section: {"repository": name}}
            try:
                jsonschema.validate(document, schema)
                schema_takes = True
            except jsonschema.ValidationError:
                schema_takes = False
            if name.endswith("\n"):  # jsonschema evaluates `$` with Python's re, which matches before a final
                continue             # newline; an ECMA-262 validator does not (the loader refuses it either way)
            assert schema_takes == bool(REPOSITORY.fullmatch(name)), (section, name)


def test_config_check_refuses_the_file_with_each_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, BAD_FILE)
    assert main(["config", "check", str(path)]) == 1
    problems = capsys.readouterr().err.splitlines()
    assert [p.split(" ", 2)[:2] for p in problems] == [[f"{path}:3:15:", "sandboxes.repository:"],
                                                      [f"{path}:5:15:", "local_jobs.repository:"]], problems
    assert all(WHAT_TO_WRITE in p for p in problems)


def test_serve_refuses_to_start_on_the_file(tmp_path: Path) -> None:
    """A process of its own: before the fix `serve` started (and ran until killed; the template it names
    does not exist, so such a run boots no VM)."""
    path = write(tmp_path, BAD_FILE + f"socket: {tmp_path}/api.sock\ntemplates: [no-such-template]\n")
    cli = Path(sys.executable).parent / "microvm-check"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        done = subprocess.run([str(cli), "serve", "--config", str(path)], capture_output=True, text=True,
                              timeout=60, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"serve started on the file instead of refusing it: {exc.stderr!r}")
    assert done.returncode == 1, done.stderr
    assert f"{path}:3:15: sandboxes.repository: '../..' {WHAT_TO_WRITE}" in done.stderr
    assert f"{path}:5:15: local_jobs.repository: '../x' {WHAT_TO_WRITE}" in done.stderr
