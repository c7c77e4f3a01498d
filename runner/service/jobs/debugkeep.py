"""How long a failed job's VM is kept for the operator to attach to (issue 37, docs/debugging.md).

Only the trusted side asks: the repository's trusted file (`debug:` in the operator's store file or,
without one, in `.github/microvm-check.yml` on the default branch) or the operator's config
(`debug.keep_seconds`); the config's `debug` section bounds both (`allowed`, `max_keep_seconds`). A pull
request's own copy of the file (in its checkout) asks for nothing: the job's log says so when it tries.
The keep itself is `JobRun`'s (runner/service/jobs/job.py): the VM stays with its job's worker, so it
counts against the service's capacity and the repository's share while kept.
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

from runner.service.config.settings import ServiceConfig
from runner.service.jobs.egress import EgressPolicies, EgressPolicyError

TRUSTED_FILE = ".github/microvm-check.yml"
_MAX_FILE_BYTES = 64 * 1024
_ASKS = re.compile(rb"^debug\s*:", re.MULTILINE)


def debug_seconds(config: ServiceConfig, policies: EgressPolicies, repository: str) -> int:
    """How long the trusted side keeps `repository`'s failed jobs' VMs, within the operator's bounds (0: not).
    A trusted file that cannot be read now keeps nothing of its own (the job ran under its policy already)."""
    settings = config.debug
    asked = settings.keep_seconds
    if settings.max_keep_seconds == 0:
        return 0  # nothing is kept here: no file to read
    if settings.allowed:
        try:
            trusted = policies.debug_for(repository)
        except EgressPolicyError:
            trusted = None
        asked = trusted if trusted is not None else asked
    return min(asked, settings.max_keep_seconds)


def refusal(config: ServiceConfig, checkout: Path) -> str | None:
    """Why a failed job whose own checkout asks for `debug:` keeps no VM (None when it does not ask)."""
    if not _checkout_asks(checkout):
        return None
    settings = config.debug
    why = ("the service's config does not allow keeping VMs (debug.allowed: false)" if not settings.allowed
           else "the operator's config keeps none (debug.max_keep_seconds: 0)" if settings.max_keep_seconds == 0
           else "neither the repository's trusted file (the operator's store file, or the default branch's "
                f"{TRUSTED_FILE}) nor the operator's config asks for it")
    return (f"debug: the checkout's {TRUSTED_FILE} asks to keep a failed job's VM; that copy is the pull "
            f"request's, which cannot keep a VM, and {why}: this job's VM is not kept (docs/debugging.md)")


def _checkout_asks(checkout: Path) -> bool:
    """Whether the checkout's own copy of the trusted file has a `debug:` key (read as bytes, never parsed)."""
    try:
        with tarfile.open(checkout, "r:") as tar:
            for member in tar:
                if member.isfile() and member.name.removeprefix("./") == TRUSTED_FILE:
                    found = tar.extractfile(member)
                    return found is not None and bool(_ASKS.search(found.read(_MAX_FILE_BYTES)))
    except (OSError, tarfile.TarError):
        return False
    return False
