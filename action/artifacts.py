"""Copies the job's artifacts out of the service's tar stream into the workspace.

The service validates artifacts already, but their names and bytes come from the guest, so this side
checks again instead of trusting one layer: only regular files and directories whose names are
relative, free of `..`, and match one of the globs the workflow asked for; bounded in count, per-file
and total size (a tar bomb stops with an error, and what was extracted so far stays). Writing goes
through directory file descriptors opened with O_NOFOLLOW, so a symlink already in the workspace
(the checkout is the guest's too) cannot redirect a write outside it, and files are written to a
temporary name and renamed, so a hard link in the workspace never gets its other names rewritten.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

COPY_CHUNK = 256 * 1024


class ArtifactError(Exception):
    """The artifact stream broke a bound or could not be read; what was extracted stays."""


@dataclass(frozen=True)
class ArtifactLimits:
    max_files: int = 10_000
    max_file_bytes: int = 1024 * 1024 * 1024
    max_total_bytes: int = 2 * 1024 * 1024 * 1024
    max_name_chars: int = 1024
    max_depth: int = 32


@dataclass
class Extraction:
    files: list[tuple[str, int]] = field(default_factory=list)  # (relative path, size)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (name as given, why)

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


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


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob as a regex: `*` and `?` stay inside one path segment, `**` spans segments."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2 :]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1 : end].replace("\\", "\\\\")
            out.append(f"[^{body[1:]}]" if body.startswith("!") else f"[{body}]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def matches(name: str, patterns: Iterable[re.Pattern[str]]) -> bool:
    """True when `name` or one of its parent directories matches a requested glob."""
    parts = name.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(p.fullmatch(c) for p in patterns for c in candidates)


def clean_name(name: str, limits: ArtifactLimits) -> str:
    """The member name as a safe relative path; ValueError says why not."""
    if "\0" in name or "\\" in name:
        raise ValueError("contains NUL or backslash")
    if len(name) > limits.max_name_chars:
        raise ValueError(f"name longer than {limits.max_name_chars} characters")
    if name.startswith("/"):
        raise ValueError("absolute path")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if not parts:
        raise ValueError("empty name")
    if ".." in parts:
        raise ValueError("contains '..'")
    if len(parts) > limits.max_depth:
        raise ValueError(f"deeper than {limits.max_depth} directories")
    if any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in parts):
        raise ValueError("a path component is longer than 255 bytes")
    return "/".join(parts)


def extract(stream: BinaryIO, dest: Path, globs: list[str],
            limits: ArtifactLimits = ArtifactLimits()) -> Extraction:
    """Extract matching regular files and directories from a tar stream under `dest`."""
    patterns = [glob_regex(clean_name(g.strip(), limits)) for g in globs if g.strip()]
    result = Extraction()
    dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            for count, member in enumerate(archive, start=1):
                _check_bounds(result, member, count, limits)
                _extract_member(archive, member, dest_fd, patterns, limits, result)
    except tarfile.TarError as exc:
        raise ArtifactError(f"artifact stream is not a valid tar: {exc}") from exc
    finally:
        os.close(dest_fd)
    return result


def _check_bounds(result: Extraction, member: tarfile.TarInfo, count: int, limits: ArtifactLimits) -> None:
    if count > limits.max_files:
        raise ArtifactError(f"more than {limits.max_files} artifact entries: stopped extracting")
    if member.isfile() and result.total_bytes + member.size > limits.max_total_bytes:
        raise ArtifactError(f"artifacts exceed {limits.max_total_bytes} bytes in total: stopped extracting")


def _extract_member(archive: tarfile.TarFile, member: tarfile.TarInfo, dest_fd: int,
                    patterns: list[re.Pattern[str]], limits: ArtifactLimits, result: Extraction) -> None:
    try:
        name = clean_name(member.name, limits)
    except ValueError as exc:
        result.refused.append((member.name[:300], str(exc)))
        return
    if member.isdir():
        if not matches(name, patterns):
            return  # a parent of matching files: created on demand, not reported
        try:
            os.close(_open_dirs(dest_fd, name.split("/")))
        except OSError as exc:
            result.refused.append((name, _why(exc)))
        return
    if not matches(name, patterns):
        result.refused.append((name, "does not match any requested artifact glob"))
        return
    if not member.isfile() or member.issparse():
        result.refused.append((name, "not a regular file or directory (links are never extracted)"))
        return
    if member.size > limits.max_file_bytes:
        result.refused.append((name, f"larger than {limits.max_file_bytes} bytes"))
        return
    source = archive.extractfile(member)
    assert source is not None  # regular members always have data
    try:
        _write_file(dest_fd, name, source, member.size)
    except OSError as exc:
        result.refused.append((name, _why(exc)))
        return
    result.files.append((name, member.size))


def _open_dirs(dest_fd: int, parts: list[str]) -> int:
    """Open (creating) nested directories without following any symlink; returns an fd."""
    fd = os.dup(dest_fd)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_file(dest_fd: int, name: str, source: BinaryIO, size: int) -> None:
    *dirs, base = name.split("/")
    dir_fd = _open_dirs(dest_fd, dirs)
    tmp = f".{base[:200]}.mvc-{secrets.token_hex(6)}"
    try:
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dir_fd)
        try:
            with os.fdopen(out_fd, "wb") as out:
                _copy_exact(source, out, size)
            _replace_regular(dir_fd, tmp, base)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _copy_exact(source: BinaryIO, out: BinaryIO, size: int) -> None:
    left = size
    while left:
        chunk = source.read(min(COPY_CHUNK, left))
        if not chunk:
            raise ArtifactError("artifact stream ended inside a file")
        out.write(chunk)
        left -= len(chunk)


def _replace_regular(dir_fd: int, tmp: str, base: str) -> None:
    try:
        existing = os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise OSError(errno.EEXIST, "exists in the workspace and is not a regular file")
    os.replace(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a parent in the workspace is a symlink or not a directory"
    return exc.strerror or str(exc)
