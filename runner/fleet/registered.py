"""The single runner `microvm-check register` sets up, given a runner credential like a fleet runner's.

Without a `runners:` section nothing but the socket's group would stand between a job and any
repository's egress policy. So the registered runner gets its own credential: its token goes into
the runner's `.env` (0600 from the start, the runner directory owner's; the runner hands it to its
steps and hooks), only its SHA-256 into the service's state directory (`registered-runners/<name>`,
root's), which the service reads at start. The `.env` also names the same root-owned hooks the
fleet's runners use: the job-started hook reports the job, the service binds the runner to it and
runs the fork guard, and the runner may then submit only for that job (runner/service/jobs/auth.py).

A registered runner takes one job after another, so its credential outlives a job and its binding
does not. A step holds the credential as well as the hooks do, so what the runner reports cannot be
what decides its job's repository: with a webhook, the service binds it only to the run GitHub's
signed `workflow_job in_progress` delivery puts on it (the credential's name is the runner's name on
GitHub); without one, the operator holds it to one repository here (`repository`, given when the
credential is issued, kept beside its digest in the root-owned store), and a credential without
one takes no job. A long-lived runner keeps its directory between jobs, so a job can still change
what the runner's next job starts with: docs/fleet.md says why the fleet is the setup for forks.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from runner.errors import ConfigError
from runner.fleet import workdir
from runner.jobapi.contract import REPOSITORY, RUNNER_TOKEN_VARIABLE, canonical_repository

CREDENTIALS = "registered-runners"  # under the service's state_dir
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_REPOSITORY_LINE = "repository "


@dataclass(frozen=True)
class Credential:
    """A registered runner's credential as the service keeps it: its token's SHA-256, and the one
    repository (canonical) the operator holds the runner to, None when it names none."""

    digest: bytes
    repository: str | None = None


def issue(state_dir: Path, name: str, runner_dir: Path, hooks_dir: Path, socket: str,
          repository: str | None = None) -> Path:
    """Give the runner in `runner_dir` a new credential (an older one of `name` stops working), held to
    `repository` when given, and the fleet's hooks; returns the `.env` written. The service reads the
    credential at its next start."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"runner name {name!r}: letters, digits, '_', '.', '-' only (at most 64)")
    if repository is not None and not REPOSITORY.fullmatch(repository):
        raise ConfigError(f"--repository {repository!r}: expected OWNER/NAME, the repository whose jobs the runner takes")
    if not runner_dir.is_dir():
        raise ConfigError(f"--runner-dir {runner_dir} is not a directory: unpack the actions/runner release there")
    token = secrets.token_urlsafe(32)
    store = state_dir / CREDENTIALS
    store.mkdir(parents=True, exist_ok=True, mode=0o700)
    held = f"{_REPOSITORY_LINE}{canonical_repository(repository)}\n" if repository is not None else ""
    _write(store / name, hashlib.sha256(token.encode()).hexdigest() + "\n" + held, 0o600, None)
    hooks = workdir.install_hooks(hooks_dir, socket)
    env_file = runner_dir / ".env"
    owner = os.stat(runner_dir)
    ours = {*hooks, workdir.NAME_VARIABLE, RUNNER_TOKEN_VARIABLE}
    lines = env_file.read_text().splitlines() if env_file.exists() else []
    kept = [line for line in lines if line.partition("=")[0] not in ours]
    values = {**{variable: str(script) for variable, script in hooks.items()}, workdir.NAME_VARIABLE: name,
              RUNNER_TOKEN_VARIABLE: token}
    _write(env_file, "".join(f"{line}\n" for line in kept) + "".join(f"{k}={v}\n" for k, v in values.items()),
           0o600, (owner.st_uid, owner.st_gid))
    return env_file


def load(state_dir: Path) -> dict[str, Credential]:
    """The registered runners' names and credentials; a file that is not one is skipped."""
    found: dict[str, Credential] = {}
    store = state_dir / CREDENTIALS
    if not store.is_dir():
        return found
    for entry in store.iterdir():
        if not NAME.fullmatch(entry.name) or not entry.is_file() or entry.is_symlink():
            continue
        credential = _parse(entry.read_text())
        if credential is not None:
            found[entry.name] = credential
    return found


def _parse(text: str) -> Credential | None:
    """A credential file: the digest's hex on the first line, then optionally `repository OWNER/NAME`
    (files written before that line existed hold the digest alone)."""
    digest, *rest = text.strip().splitlines() or [""]
    if not _DIGEST.fullmatch(digest) or len(rest) > 1:
        return None
    if not rest:
        return Credential(bytes.fromhex(digest))
    repository = rest[0].removeprefix(_REPOSITORY_LINE)
    if repository == rest[0] or not REPOSITORY.fullmatch(repository):
        return None
    return Credential(bytes.fromhex(digest), canonical_repository(repository))


def _write(path: Path, text: str, mode: int, owner: tuple[int, int] | None) -> None:
    """Created with `mode` (never wider, not even for an instant), owned by `owner`, then put in place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.unlink(missing_ok=True)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)
