"""Installing `microvm-check guard` as the runner's job-started hook.

The actions runner reads `.env` in its own directory at start, and runs the script named by
`ACTIONS_RUNNER_HOOK_JOB_STARTED` before the first step of every job; a non-zero exit fails the job.
Registration installs the guard there, so no job reaches this host's runner unchecked.

The runner starts the hook in the job's workspace, which on a long-lived runner still holds the
previous job's checkout: possibly a fork's. A plain `python -m runner.cli` there would import a
committed `runner/cli.py` or `sitecustomize.py` from it, on the host, before any check. So the
script leaves that directory first, drops every `PYTHON*` variable, and runs the interpreter by
absolute path with `-I` (no current or script directory on `sys.path`, `PYTHON*` ignored, no user
site-packages): nothing the job controls decides what code the hook runs.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from runner.github.errors import GitHubError

HOOK_VARIABLE = "ACTIONS_RUNNER_HOOK_JOB_STARTED"
HOOK_SCRIPT = "microvm-check-guard.sh"
# POSIX sh, builtins only (no PATH lookup before the exec). `set -f`: the unquoted `export -p`
# words must not be globbed. A word is unset only when it looks like `PYTHON<name>=`: a variable's
# value split into words can at worst name another PYTHON* variable, which is unset as well.
ISOLATION = """\
set -f
cd / || exit 1
for word in $(export -p); do
  name=${word%%=*}
  case $word in PYTHON*=*) case $name in *[!A-Za-z0-9_]*) ;; *) unset "$name" ;; esac ;; esac
done
"""


def guard_argv(config: Path | None, rules: Path | None) -> list[str]:
    """This interpreter, isolated (`-I`), running this code base's CLI; every path absolute, so
    the hook works without a PATH and whatever its working directory."""
    if not os.path.isabs(sys.executable):
        raise GitHubError(
            f"cannot tell this Python's absolute path ({sys.executable!r}): run microvm-check register "
            "with the installation's own interpreter, e.g. /opt/microvm-check/.venv/bin/microvm-check"
        )
    argv = [sys.executable, "-I", "-m", "runner.cli", "guard"]
    if config:
        argv += ["--config", str(config.resolve())]
    if rules:
        argv += ["--rules", str(rules.resolve())]
    return argv


def hook_script(argv: Sequence[str]) -> str:
    """The hook's text: leave the workspace, clear `PYTHON*`, then exec `argv` (absolute)."""
    if not argv or not os.path.isabs(argv[0]):
        raise GitHubError(f"the hook's command must start with an absolute path, not {argv[:1]!r}")
    header = (
        "#!/bin/sh\n# Installed by `microvm-check register`: see runner/fleet/hook.py.\n"
        "# Runs in the job's workspace, which a fork may have filled: leave it, trust nothing in it.\n"
    )
    return f"{header}{ISOLATION}exec {shlex.join(argv)}\n"


def install_guard_hook(runner_dir: Path, argv: Sequence[str]) -> Path:
    """Write the hook script and point the runner's `.env` at it; returns the script's path.

    Other `.env` settings are kept; an older hook setting is replaced, never duplicated.
    """
    script = runner_dir.resolve() / HOOK_SCRIPT
    if any(character.isspace() for character in str(script)):
        raise GitHubError(
            f"the runner passes the hook's path to bash unquoted (`bash -e PATH`), so a hook in {str(runner_dir)!r} "
            "would not run and every job would fail: unpack the runner in a directory whose path has no spaces"
        )
    _write(script, hook_script(argv), 0o755)
    env_file = runner_dir / ".env"
    lines = env_file.read_text().splitlines() if env_file.exists() else []
    kept = [line for line in lines if not line.startswith(f"{HOOK_VARIABLE}=")]
    _write(env_file, "\n".join([*kept, f"{HOOK_VARIABLE}={script}"]) + "\n", 0o644)
    return script


# -- the fleet's runners (runner.fleet): the hooks report to the service, which runs the guard -----------


def job_started(socket: str, environ: Mapping[str, str], out: TextIO) -> int:
    """The fleet runner's job-started hook: report the job to the service with the runner's token, and
    let the service's guard decide. Exit 1 (the runner fails the job before any step) when it refuses,
    or when the service cannot be asked: the guard fails closed."""
    from runner.fleet import report
    from runner.github import guard
    from runner.jobapi.client import JobAPIError, JobClient
    from runner.jobapi.contract import RUNNER_TOKEN_VARIABLE, Verdict, WireError

    try:
        job = report.from_environment(environ)
        try:
            context: dict[str, Any] | None = guard.reported_context(environ)
        except GitHubError as exc:  # the service's guard refuses a job it cannot see; the reason goes with it
            out.write(f"microvm-check: the job's event could not be read: {exc}\n")
            context = None
        started = dataclasses.replace(job, guard=context)
        with JobClient(socket=socket, runner_token=_runner_token(environ, RUNNER_TOKEN_VARIABLE)) as client:
            verdict = client.job_started(started)
    except (ValueError, JobAPIError, WireError) as exc:
        verdict = Verdict(False, (f"the job could not be reported to the microvm-check service ({exc}), "
                                  "so it is refused.",))
    for line in guard.error_lines(guard.Verdict(verdict.allowed, verdict.reasons)):
        out.write(line + "\n")
    if verdict.allowed:
        out.write("microvm-check: job reported to the service; the fork guard allows it\n")
    out.flush()
    return 0 if verdict.allowed else 1


def job_completed(socket: str, environ: Mapping[str, str], out: TextIO) -> int:
    """The fleet runner's job-completed hook: the service cancels whatever this runner's job still runs
    and destroys its VMs. Never fails: the job has ended either way."""
    from runner.jobapi.client import JobAPIError, JobClient
    from runner.jobapi.contract import RUNNER_TOKEN_VARIABLE, WireError

    try:
        with JobClient(socket=socket, runner_token=_runner_token(environ, RUNNER_TOKEN_VARIABLE)) as client:
            cancelled = client.job_completed()
    except (ValueError, JobAPIError, WireError) as exc:
        out.write(f"::warning::microvm-check: could not tell the service this job ended: {exc}\n")
        return 0
    if cancelled:
        out.write(f"microvm-check: cancelled what this job still ran: {', '.join(cancelled)}\n")
    out.flush()
    return 0


def _runner_token(environ: Mapping[str, str], variable: str) -> str:
    token = environ.get(variable, "")
    if not token:
        raise ValueError(f"{variable} is not set: this runner was not started by the microvm-check fleet")
    return token


def _write(path: Path, text: str, mode: int) -> None:
    """Replace the file in one step, so a runner starting meanwhile never reads half of it."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text)
    temporary.chmod(mode)
    temporary.replace(path)
