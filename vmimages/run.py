"""Running the host tools a template build needs, with errors that show what they said."""

from __future__ import annotations

import subprocess
from pathlib import Path

from runner.errors import TemplateError


class BuildError(TemplateError):
    """A build step failed; the message names the step and carries the tool's own output."""


def run(argv: list[str], cwd: Path | None = None) -> str:
    """Run a host tool and return its stdout; a failure raises BuildError with the tool's own words."""
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise BuildError(f"{argv[0]} failed (exit {proc.returncode}): {' '.join(argv)}\n{tail}")
    return proc.stdout
