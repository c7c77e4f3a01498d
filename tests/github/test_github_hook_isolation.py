"""The installed job-started hook runs nothing from the directory it starts in (a job's workspace)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from runner.fleet.hook import guard_argv, hook_script, install_guard_hook
from runner.github.errors import GitHubError
from tests.github.github_fakes import load_payload

SAME_REPO_PR = "listendev-lstn.pull_request.opened.same-repo.reviewdog.json"
RUNNER_SHELL = ["/bin/bash", "-e"]  # how the runner starts a .sh job hook (GitHub's docs: bash -e FILE, else sh)


def hostile_tree(root: Path, markers: Path) -> list[Path]:
    """The files a fork commits so that Python imports them: each writes a marker when it runs."""
    planted = []
    for relative in ("runner/__init__.py", "runner/cli.py", "sitecustomize.py", "usercustomize.py", "startup.py"):
        marker = markers / (str(root.name) + "-" + relative.replace("/", "-") + ".ran")
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
        planted.append(marker)
    return planted


def hook_env(tmp_path: Path, hostile: Path) -> dict[str, str]:
    event = tmp_path / "event.json"
    event.write_text(json.dumps(load_payload(SAME_REPO_PR)))
    return {
        "PATH": "/usr/bin:/bin",
        "GITHUB_EVENT_NAME": "pull_request",
        "GITHUB_EVENT_PATH": str(event),
        "GITHUB_REPOSITORY": "reviewdog/reviewdog",
        "PYTHONPATH": str(hostile),
        "PYTHONSTARTUP": str(hostile / "startup.py"),
        "PYTHONUSERBASE": str(hostile),
    }


def run_hook(script: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RUNNER_SHELL, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_the_installed_hook_imports_nothing_from_the_workspace(tmp_path) -> None:
    """Run the script `register` installs, as the runner would, in a workspace a fork filled,
    with PYTHONPATH and PYTHONSTARTUP pointing at more of the fork's files."""
    markers = tmp_path / "markers"
    markers.mkdir()
    workspace, elsewhere = tmp_path / "workspace", tmp_path / "pythonpath"
    planted = hostile_tree(workspace, markers) + hostile_tree(elsewhere, markers)
    runner_dir = tmp_path / "actions-runner"
    runner_dir.mkdir()
    script = install_guard_hook(runner_dir, guard_argv(None, None))
    env = hook_env(tmp_path, elsewhere)

    allowed = run_hook(script, workspace, env)

    assert [marker.name for marker in planted if marker.exists()] == []
    assert allowed.returncode == 0, allowed.stderr
    assert "microvm-check guard: job allowed" in allowed.stderr  # the real guard ran, not a stand-in
    env["GITHUB_REPOSITORY"] = "someone/else"
    refused = run_hook(script, workspace, env)
    assert refused.returncode == 1 and refused.stdout.startswith("::error title=microvm-check guard::")
    assert [marker.name for marker in planted if marker.exists()] == []


@pytest.mark.parametrize("shell", [["/bin/bash", "-e"], ["/bin/sh", "-e"]])
def test_the_hook_leaves_the_workspace_and_drops_python_variables(tmp_path, shell) -> None:
    """What the hook hands to the program it starts: `/` as its directory, no PYTHON* variable,
    every other variable (the guard needs GITHUB_*) untouched, even with odd values around."""
    script = install_guard_hook(tmp_path, ["/usr/bin/env"])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "/x", "PYTHONINSPECT": "1", "PYTHONSAFEPATH": "",
           "GITHUB_EVENT_NAME": "pull_request", "ODD": "a *  PYTHON-bad=1 PYTHONHOME=/y\n;PATH=/evil"}
    out = subprocess.run([*shell, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    names = {line.partition("=")[0] for line in out.stdout.splitlines()}
    assert not {name for name in names if name.startswith("PYTHON")}
    assert {"GITHUB_EVENT_NAME", "ODD", "PATH"} <= names and "PATH=/usr/bin:/bin" in out.stdout.splitlines()
    assert "PWD=/" in out.stdout.splitlines()


def test_the_hook_argv_is_absolute_and_isolated(tmp_path) -> None:
    argv = guard_argv(tmp_path / "github.yml", None)
    assert Path(argv[0]).is_absolute() and argv[1] == "-I"
    assert argv[argv.index("--config") + 1] == str((tmp_path / "github.yml").resolve())
    with pytest.raises(GitHubError, match="must start with an absolute path"):
        hook_script(["python3", "-I", "-m", "runner.cli", "guard"])


def test_a_runner_directory_with_a_space_is_refused_before_every_job_fails(tmp_path) -> None:
    """The runner starts the hook as `bash -e {path}` with the path unquoted: `/opt/actions runner/...`
    would run `/opt/actions` and fail every job. Registration says so instead of installing it."""
    runner_dir = tmp_path / "actions runner"
    runner_dir.mkdir()
    with pytest.raises(GitHubError, match=r"passes the hook's path to bash unquoted.*'.*actions runner'"):
        install_guard_hook(runner_dir, ["/usr/bin/env"])
    assert not (runner_dir / ".env").exists()
