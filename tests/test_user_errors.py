"""What a user sees of their own mistakes: one actionable line and a non-zero exit, never a traceback.

Each case runs the installed `microvm-check` command as a user would (a process, its stdout and stderr
as the terminal shows them). `--debug` is the way to a traceback, for a bug report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require

CLI = [str(Path(sys.executable).parent / "microvm-check")]  # the venv's command, as scripts/setup installs it
ROOT = Path(__file__).resolve().parent.parent


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MICROVM_CHECK")}
    return subprocess.run([*CLI, *argv], cwd=cwd, capture_output=True, text=True, timeout=180, env=env,
                          check=False)


def _one_line(done: subprocess.CompletedProcess[str], *expected: str) -> str:
    seen = done.stdout + done.stderr
    assert done.returncode != 0, seen
    assert "Traceback" not in seen, seen
    lines = [line for line in seen.splitlines() if line.strip()]
    assert len(lines) == 1, f"not one line: {seen}"
    for part in expected:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    co = tmp_path / "co"
    co.mkdir()
    (co / "check.sh").write_text("true\n")
    return co


def test_an_unknown_option(checkout: Path) -> None:
    done = _run(["run", "--no-such-option", "--", "true"], checkout)
    assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == "microvm-check: error: unrecognized arguments: --no-such-option"


def test_a_service_that_is_not_running(checkout: Path) -> None:
    _one_line(_run(["jobs", "--socket", str(checkout / "no.sock")], checkout),
              "cannot reach the job service", "is the service running?")


def test_a_config_file_with_errors(checkout: Path) -> None:
    bad = checkout / "service.yml"
    bad.write_text(f"socket: {checkout}/api.sock\nmax_concurrent_jobs: lots\n")
    for argv in (["serve", "--config", str(bad)], ["config", "check", str(bad)], ["jobs", "--config", str(bad)]):
        _one_line(_run(argv, checkout), f"{bad}:2:", "max_concurrent_jobs")


def test_a_missing_file(checkout: Path) -> None:
    _one_line(_run(["policy", "check", "nosuch.yml"], checkout), "nosuch.yml")
    _one_line(_run(["run", "--policy", "nosuch.yml", "--", "true"], checkout), "--policy nosuch.yml", "cannot read")


def _need_local_service() -> None:
    """A `run` without a service starts one on this host's templates: root and the built template."""
    require(os.geteuid() == 0, "not running as root")
    require(Path("/var/lib/microvm-check/templates/base/current").exists(), "the template 'base' is not built")


def test_a_missing_template(checkout: Path) -> None:
    _need_local_service()
    line = _one_line(_run(["run", "--socket", str(checkout / "no.sock"), "--template", "nosuch", "--", "true"],
                          checkout), "nosuch")
    assert "microvm-check template build nosuch" in line


def test_a_job_refused_by_its_policy(checkout: Path) -> None:
    _need_local_service()
    (checkout / "policy.yml").write_text("version: 1\nmode: block\nallow:\n  - host: [oops\n")
    _one_line(_run(["run", "--socket", str(checkout / "no.sock"), "--policy", "policy.yml", "--", "true"], checkout),
              "refused the job", "job policy:5:")


def test_debug_shows_the_traceback_for_a_bug_report(checkout: Path) -> None:
    done = _run(["--debug", "jobs", "--socket", str(checkout / "no.sock")], checkout)
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("microvm-check: cannot reach the job service")


def test_the_service_log_keeps_a_jobs_traceback_at_debug_unless_it_is_a_bug(caplog: pytest.LogCaptureFixture) -> None:
    from runner.errors import TemplateError
    from runner.service.jobs.job import _log_failure

    caplog.set_level("DEBUG", logger="runner.service.jobs.job")
    _log_failure("j1", TemplateError("no template named 'nosuch': build it with ..."))
    _log_failure("j2", KeyError("a bug"))
    by_level = {(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records}
    assert by_level == {("WARNING", "job j1 failed: no template named 'nosuch': build it with ...", False),
                        ("DEBUG", "job j1 failed", True), ("WARNING", "job j2 failed", True)}
