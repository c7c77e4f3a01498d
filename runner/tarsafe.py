"""Unpacking a tar stream that came from a guest, on the host, without trusting a byte of it.

Only regular files and directories are written, by our own code, under names we have checked:
no absolute paths, no `..`, no links of any kind, no devices, each file created fresh with
O_NOFOLLOW|O_EXCL. Since we never create a link, nothing written later can be redirected outside
the destination. Count and size are bounded while streaming, so a tar bomb stops early.
Python's own tarfile extraction filters are not used: several of their bypasses were only fixed
in later patch releases than the ones Debian ships.
"""

from __future__ import annotations

import os
import posixpath
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

COPY_CHUNK = 1024 * 1024


class UnsafeTar(ValueError):
    """The stream holds something we refuse to write; the message names the member."""


@dataclass
class Limits:
    max_members: int = 10_000
    max_bytes: int = 1024**3
    max_name: int = 1024


@dataclass
class Extracted:
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # links and other member types, by name


def safe_name(name: str, max_len: int = 1024) -> str:
    """The member's relative path, normalised, or UnsafeTar."""
    if not name or len(name) > max_len or "\0" in name:
        raise UnsafeTar(f"member name {name[:80]!r} is empty, too long or has a NUL byte")
    norm = posixpath.normpath(name)
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise UnsafeTar(f"member {name!r} would land outside the destination")
    return "" if norm == "." else norm


def extract(stream: BinaryIO, dest: Path, limits: Limits | None = None, skip_links: bool = False) -> Extracted:
    """Unpack `stream` into the existing directory `dest`.

    Links raise UnsafeTar, or with `skip_links` are left out and listed in `skipped`.
    """
    limits = limits or Limits()
    report = Extracted()
    dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for count, member in enumerate(tar, start=1):
                if count > limits.max_members:
                    raise UnsafeTar(f"more than {limits.max_members} members")
                name = safe_name(member.name, limits.max_name)
                if member.isdir():
                    if name:
                        _mkdirs(dest_fd, name)
                elif member.isreg():
                    if member.size > limits.max_bytes - report.bytes:
                        raise UnsafeTar(f"member {name!r} would exceed the {limits.max_bytes}-byte limit")
                    _write_file(dest_fd, name, tar.extractfile(member), member.mode, member.size)
                    report.files.append(name)
                    report.bytes += member.size
                elif skip_links and (member.issym() or member.islnk()):
                    report.skipped.append(name)
                else:
                    raise UnsafeTar(f"member {name!r} is a {_kind(member)}: only files and directories are accepted")
    except tarfile.TarError as exc:
        raise UnsafeTar(f"not a valid tar stream: {exc}") from None
    finally:
        os.close(dest_fd)
    return report


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return "symbolic link"
    if member.islnk():
        return "hard link"
    if member.isdev():
        return "device"
    if member.isfifo():
        return "fifo"
    return "special member"


def _mkdirs(dest_fd: int, rel: str) -> int:
    """Create `rel` below dest_fd one component at a time, never following a link; return its fd."""
    fd = os.dup(dest_fd)
    for part in rel.split("/"):
        try:
            os.mkdir(part, 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        try:
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise UnsafeTar(f"cannot enter {rel!r}: {exc.strerror}") from None
        os.close(fd)
        fd = nxt
    return fd


def _write_file(dest_fd: int, rel: str, src: BinaryIO, mode: int, size: int) -> None:
    parent, _, base = rel.rpartition("/")
    dir_fd = _mkdirs(dest_fd, parent) if parent else os.dup(dest_fd)
    try:
        perms = 0o755 if mode & 0o111 else 0o644
        try:
            fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, perms, dir_fd=dir_fd)
        except FileExistsError:
            raise UnsafeTar(f"member {rel!r} appears twice") from None
        with os.fdopen(fd, "wb") as out:
            left = size
            while left:
                chunk = src.read(min(COPY_CHUNK, left))
                if not chunk:
                    raise UnsafeTar(f"member {rel!r} is truncated")
                out.write(chunk)
                left -= len(chunk)
    finally:
        os.close(dir_fd)
