"""The job's signed record, written by the action next to the artifacts: `<artifacts-path>/microvm-check.intoto.jsonl`.

The service signs every job's record as it ends (runner/service/jobs/attestation.py); the action fetches the
envelope and writes it as is (it checks nothing: `microvm-check verify` does, with a key the verifier
trusts). The workspace holds the fork's checkout, so the directory is opened without following a link
at any step (a checkout's `artifacts -> ~/.ssh` link stops the write), and the file is written under a
temporary name and renamed into place, so no existing file or hard link is written through.

A step that asked for no artifacts has no artifacts directory and gets none made for it (a later step
of the job may want that name for its artifacts): its envelope goes to RUNNER_TEMP. Either way the
path is the step's `attestation` output.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from runner import tarsafe

ENVELOPE_FILE = "microvm-check.intoto.jsonl"  # runner.attest.statement.ENVELOPE_FILE


def write_envelope(data: bytes, workspace: Path, artifacts_path: str | None, temp: Path | None, job_id: str) -> Path:
    """Write `data` (one envelope line) and return where: in the artifacts directory when given, else in
    `temp` as `microvm-check-<job>.intoto.jsonl`. Raises OSError or ArchiveError when it cannot."""
    if artifacts_path is None:
        where = temp or Path(os.environ.get("TMPDIR", "/tmp"))
        name = f"microvm-check-{job_id}.intoto.jsonl"
        _write_at(os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), name, data)
        return where / name
    parts = tarsafe.safe_name(artifacts_path).split("/")
    root = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = tarsafe.open_dirs(root, parts)
    finally:
        os.close(root)
    _write_at(fd, ENVELOPE_FILE, data)
    return workspace / "/".join(parts) / ENVELOPE_FILE


def _write_at(dir_fd: int, name: str, data: bytes) -> None:
    """`name` in the directory `dir_fd` (closed here) replaced by a file holding `data`."""
    tmp = f".{name}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    finally:
        os.close(dir_fd)
