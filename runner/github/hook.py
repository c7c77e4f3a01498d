"""Installing `microvm-check guard` as the runner's job-started hook.

The actions runner reads `.env` in its own directory at start, and runs the script named by
`ACTIONS_RUNNER_HOOK_JOB_STARTED` before the first step of every job; a non-zero exit fails the job.
Registration installs the guard there, so no job reaches this host's runner unchecked.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

HOOK_VARIABLE = "ACTIONS_RUNNER_HOOK_JOB_STARTED"
HOOK_SCRIPT = "microvm-check-guard.sh"


def guard_argv(config: Path | None, rules: Path | None) -> list[str]:
    """This interpreter running this code base's CLI, so the hook works without a PATH."""
    argv = [sys.executable, "-m", "runner.cli", "guard"]
    if config:
        argv += ["--config", str(config.resolve())]
    if rules:
        argv += ["--rules", str(rules.resolve())]
    return argv


def install_guard_hook(runner_dir: Path, argv: Sequence[str]) -> Path:
    """Write the hook script and point the runner's `.env` at it; returns the script's path.

    Other `.env` settings are kept; an older hook setting is replaced, never duplicated.
    """
    script = runner_dir / HOOK_SCRIPT
    header = "#!/bin/sh\n# Installed by `microvm-check register`: see runner/github/guard.py.\n"
    _write(script, f"{header}exec {shlex.join(argv)}\n", 0o755)
    env_file = runner_dir / ".env"
    lines = env_file.read_text().splitlines() if env_file.exists() else []
    kept = [line for line in lines if not line.startswith(f"{HOOK_VARIABLE}=")]
    _write(env_file, "\n".join([*kept, f"{HOOK_VARIABLE}={script.resolve()}"]) + "\n", 0o644)
    return script


def _write(path: Path, text: str, mode: int) -> None:
    """Replace the file in one step, so a runner starting meanwhile never reads half of it."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text)
    temporary.chmod(mode)
    temporary.replace(path)
