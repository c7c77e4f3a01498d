"""A hostile artifact tar cannot reach the runner checkout's .git (issue 8, item 3).

The tar is hand-made, as root in the guest could make it, and fed to the action's real artifact path
(`JobDriver._artifacts`); then real `git` commands run on the host checkout, the way the next job's
`actions/checkout` would, and must run no hook and find the config unchanged.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from action.__main__ import JobDriver
from action.inputs import Inputs
from tests.action.job_records import job_record

GLOBS = ["**", "*", "**/*", "hooks/*", "config"]


def git(workspace: Path, *args: str) -> str:
    env = {"PATH": os.environ["PATH"], "HOME": str(workspace.parent), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    done = subprocess.run(["git", *args], cwd=workspace, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A runner checkout whose fork committed `sub -> .git` (and uses `working-directory: sub`)."""
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    git(workspace, "init", "-q", "-b", "main")
    (workspace / "README").write_text("hello\n")
    os.symlink(".git", workspace / "sub")
    git(workspace, "add", "README", "sub")
    git(workspace, "commit", "-q", "-m", "fork")
    return workspace


def hostile_tar(pwned: Path) -> bytes:
    """Every way a guest could name the host's .git: directly, in other letter cases, and through `sub`."""
    hook = f"#!/bin/sh\necho ran >> {pwned}\n".encode()
    config = f"[core]\n\tfsmonitor = echo fsmonitor >> {pwned}; false\n\thooksPath = hooks\n".encode()
    members = [
        (".git/hooks/post-checkout", hook), (".git/hooks/pre-commit", hook), (".git/config", config),
        (".GIT/hooks/post-checkout", hook), (".Git/config", config), ("sub/hooks/post-checkout", hook),
        ("hooks/post-checkout", hook), ("hooks/reference-transaction", hook), ("config", config),
        ("report.xml", b"<testsuite/>"),
    ]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class ArtifactClient:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def artifacts(self, job_id: str, out) -> int:
        out.write(self.data)
        return len(self.data)


def fetch(workspace: Path, temp: Path, data: bytes, **inputs: object):
    fields = dict(run="true", working_directory="sub", policy="", artifacts=GLOBS, timeout_minutes=10,
                  template="base", env_names=[], socket="/nonexistent", include_git=False)
    out = io.StringIO()
    run = JobDriver(ArtifactClient(data), Inputs(**{**fields, **inputs}), workspace, out,
                 {"RUNNER_TEMP": str(temp)})
    run.job_id = "j1"
    return run._artifacts(), out.getvalue()


def test_a_hostile_tar_never_reaches_git_and_git_runs_nothing(checkout: Path, tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    config_before = (checkout / ".git" / "config").read_bytes()
    hooks_before = sorted(p.name for p in (checkout / ".git" / "hooks").iterdir())

    extraction, _ = fetch(checkout, temp, hostile_tar(pwned))

    # What is not .git lands in the new artifacts directory; every .git spelling is skipped and named.
    assert sorted(file.path for file in extraction.files) == ["config", "hooks/post-checkout",
                                                           "hooks/reference-transaction", "report.xml",
                                                           "sub/hooks/post-checkout"]
    assert sorted(name for name, _ in extraction.skipped) == [".GIT/hooks/post-checkout", ".Git/config",
                                                             ".git/config", ".git/hooks/post-checkout",
                                                             ".git/hooks/pre-commit"]
    assert (checkout / "artifacts" / "report.xml").read_bytes() == b"<testsuite/>"
    assert (checkout / ".git" / "config").read_bytes() == config_before
    assert sorted(p.name for p in (checkout / ".git" / "hooks").iterdir()) == hooks_before
    assert list(temp.iterdir()) == [], "the fresh directory under RUNNER_TEMP was moved or removed"

    # The next job's git commands on this checkout: none of the planted hooks or monitors runs.
    git(checkout, "status", "--porcelain")
    git(checkout, "checkout", "-q", "-b", "next")
    git(checkout, "checkout", "-q", "main")
    (checkout / "README").write_text("changed\n")
    git(checkout, "commit", "-q", "-am", "next job")
    assert not pwned.exists(), pwned.read_text()
    assert (checkout / ".git" / "config").read_bytes() == config_before


def test_artifacts_path_through_a_committed_symlink_is_refused(checkout: Path, tmp_path: Path) -> None:
    """`artifacts-path: sub/x` would be .git/x through the fork's symlink: parents are never followed."""
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    extraction, log = fetch(checkout, temp, hostile_tar(tmp_path / "pwned"), artifacts_path="sub/hooks")
    assert extraction.files == []
    assert "::warning::artifacts: cannot reach sub/hooks in the workspace without following a link" in log
    assert not (checkout / ".git" / "hooks" / "hooks").exists()
    assert not (checkout / ".git" / "hooks" / "report.xml").exists()


@pytest.mark.parametrize("existing", ["file", "dir", "symlink"])
def test_an_existing_artifacts_path_is_never_written_into(checkout: Path, tmp_path: Path, existing: str) -> None:
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    target = checkout / "artifacts"
    if existing == "file":
        target.write_text("the fork's own file\n")
    elif existing == "dir":
        target.mkdir()
        (target / "report.xml").write_text("the fork's own report\n")
    else:
        target.symlink_to(".git")
    extraction, log = fetch(checkout, temp, hostile_tar(tmp_path / "pwned"))
    assert extraction.files == []
    assert "artifacts already exists in the workspace" in log
    assert not (checkout / ".git" / "report.xml").exists()
    if existing == "dir":
        assert (target / "report.xml").read_text() == "the fork's own report\n"


@pytest.mark.parametrize("required,expected", [(False, 0), (True, 1)])
def test_skipped_artifacts_fail_the_step_only_when_required(checkout: Path, tmp_path: Path, required: bool,
                                                            expected: int) -> None:
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    out = io.StringIO()
    inputs = Inputs(run="true", working_directory=".", policy="", artifacts=["**"], timeout_minutes=10,
                    template="base", env_names=[], socket="/nonexistent", include_git=False,
                    artifacts_required=required)
    run = JobDriver(ArtifactClient(hostile_tar(tmp_path / "pwned")), inputs, checkout, out,
                 {"RUNNER_TEMP": str(temp)})
    run.job_id = "j1"
    extraction = run._artifacts()
    assert extraction.files and extraction.skipped
    assert run._exit_code(job_record({"state": "finished", "exit_code": 0}), extraction) == expected
    assert run._exit_code(job_record({"state": "finished", "exit_code": 3}), extraction) == 3
    assert ("::error::artifacts-required: 5 problem(s)" in out.getvalue()) is required
