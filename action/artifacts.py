"""Copies the job's artifacts out of the service's tar stream into the workspace.

The service validates artifacts already, but their names and bytes come from the guest, so this side
checks again instead of trusting one layer, with the host's rules for guest tars (`runner.tarsafe`:
plain relative names, no `.git` component, only files and directories, bounded count and size), and
takes only what matches the globs the workflow asked for.

Artifacts never land where the host executes or configures anything: they are extracted into a fresh
directory under RUNNER_TEMP, which is then moved to a directory of the workspace that must not exist
yet (`artifacts/` unless the workflow names another), reached without following any symlink. So no
artifact is ever written over a file of the checkout, into its `.git`, or through a link a fork
committed (`sub -> .git`).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from runner import tarsafe
from runner.errors import ArchiveError
from runner.tarsafe import Extracted as Extraction
from runner.tarsafe import Limits as ArtifactLimits

__all__ = ["ArtifactError", "ArtifactLimits", "BoundedWriter", "Extraction", "Glob", "deliver", "extract",
           "glob_regex", "matches", "place"]


class ArtifactError(ArchiveError):
    """The artifact stream broke a bound or could not be read; what was extracted stays."""


class BoundedWriter:
    """A file wrapper that refuses to grow past a limit, so a download cannot fill the disk."""

    def __init__(self, handle: BinaryIO, limit: int) -> None:
        self._handle = handle
        self._limit = limit
        self.written = 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        if self.written > self._limit:
            raise ArtifactError(f"artifact stream exceeds {self._limit} bytes")
        return self._handle.write(data)


@dataclass(frozen=True)
class Glob:
    """A glob read as the guest's `glob.glob(recursive=True)` reads it, so the host never drops a file
    the guest matched: each path segment is an fnmatch pattern (`*`, `?`, `[...]`, `[!...]`, with
    fnmatch's rules for `]`, `^` and empty ranges), and a `**` segment spans any number of segments."""

    segments: tuple[str, ...]

    def fullmatch(self, path: str) -> bool:
        parts = path.split("/")
        reach = {0}  # how many leading parts the segments so far can match
        for segment in self.segments:
            if segment == "**":
                reach = set(range(min(reach), len(parts) + 1))
            else:
                reach = {j + 1 for j in reach if j < len(parts) and fnmatch.fnmatchcase(parts[j], segment)}
            if not reach:
                return False
        return len(parts) in reach


def glob_regex(pattern: str) -> Glob:
    """The matcher for one requested glob (a normalised relative path, see tarsafe.safe_name)."""
    return Glob(tuple(pattern.split("/")))


def matches(name: str, patterns: Iterable[Glob]) -> bool:
    """True when `name` or one of its parent directories matches a requested glob."""
    parts = name.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(p.fullmatch(c) for p in patterns for c in candidates)


def extract(stream: BinaryIO, dest: Path, globs: list[str],
            limits: ArtifactLimits = ArtifactLimits()) -> Extraction:
    """Extract matching regular files and directories from a tar stream under `dest`."""
    try:
        patterns = [glob_regex(tarsafe.safe_name(g.strip(), limits)) for g in globs if g.strip()]
    except tarsafe.UnsafeTar as exc:
        raise ArtifactError(f"artifact glob refused: {exc}") from None

    def refuse(name: str, member: tarfile.TarInfo) -> str | None:
        return None if matches(name, patterns) else "does not match any requested artifact glob"

    try:
        return tarsafe.extract(stream, dest, limits, refuse)
    except tarsafe.UnsafeTar as exc:
        raise ArtifactError(f"artifacts: {exc}") from exc


def deliver(stream: BinaryIO, workspace: Path, target: str, globs: list[str], temp_root: Path | None,
            limits: ArtifactLimits = ArtifactLimits()) -> Extraction:
    """Extract into a fresh directory under `temp_root`, then move it to `target` in the workspace.

    Nothing is placed when extraction fails as a whole (ArtifactError); skipped members are listed.
    """
    fresh = Path(tempfile.mkdtemp(prefix="microvm-check-artifacts-", dir=temp_root))
    try:
        result = extract(stream, fresh, globs, limits)
        if result.files:
            place(fresh, workspace, target)
        return result
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def place(fresh: Path, workspace: Path, target: str) -> None:
    """Move the directory `fresh` to `target` under `workspace`, which must not exist yet.

    Parents are opened (created if missing) without following symlinks, and `target` is created
    with mkdir first, so an existing file, directory or link of that name stops the move.
    """
    try:
        name = tarsafe.safe_name(target)
    except tarsafe.UnsafeTar as exc:
        raise ArtifactError(f"artifacts-path {target!r} refused: {exc}") from None
    if not name or tarsafe.refused_name(name):
        raise ArtifactError(f"artifacts-path {target!r} refused: not a plain directory outside .git")
    *parents, base = name.split("/")
    root_fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        parent_fd = tarsafe.open_dirs(root_fd, parents)
    except OSError as exc:
        raise ArtifactError(f"cannot reach {name} in the workspace without following a link: {exc.strerror}") from None
    finally:
        os.close(root_fd)
    try:
        _take_name(parent_fd, name, base)
        try:
            os.rename(fresh, base, dst_dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise ArtifactError(f"cannot move the artifacts to {name}: {exc.strerror}") from None
            _copy_tree(fresh, parent_fd, base)
    finally:
        os.close(parent_fd)


def _take_name(parent_fd: int, name: str, base: str) -> None:
    try:
        os.mkdir(base, 0o755, dir_fd=parent_fd)
    except FileExistsError:
        raise ArtifactError(f"{name} already exists in the workspace: artifacts are never written over the "
                            "checkout's files; remove it first or name another directory with artifacts-path") from None


def _copy_tree(src: Path, parent_fd: int, base: str) -> None:
    """The fallback when RUNNER_TEMP is on another file system: our own writes, no links followed."""
    dest_fd = tarsafe.open_dirs(parent_fd, [base])
    try:
        for dirpath, _dirs, files in os.walk(src):
            rel = os.path.relpath(dirpath, src)
            dir_fd = tarsafe.open_dirs(dest_fd, [] if rel == "." else rel.split(os.sep))
            try:
                for file_name in files:
                    _copy_file(Path(dirpath) / file_name, dir_fd, file_name)
            finally:
                os.close(dir_fd)
    finally:
        os.close(dest_fd)


def _copy_file(src: Path, dir_fd: int, name: str) -> None:
    mode = os.stat(src, follow_symlinks=False).st_mode & 0o755
    out_fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    with open(src, "rb") as source, os.fdopen(out_fd, "wb") as out:
        shutil.copyfileobj(source, out, tarsafe.COPY_CHUNK)
