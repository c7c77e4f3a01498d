"""Tar streams whose names and bytes a guest chose, handled on the host without trusting any of it.

One place for the rules, used wherever guest files reach the host (`Sandbox.copy_out`, the service's
artifact check, `microvm-check run`, the action's artifact copy):

- a member name is a plain relative path: no NUL or control characters, no backslash, not absolute,
  no `..`, bounded in length and depth;
- only regular files and directories are ever written, by our own code: never a link, a device or
  a fifo, so nothing written later can be redirected by something written before;
- directories are entered with O_NOFOLLOW, files are written to a fresh temporary name and renamed,
  so neither a symlink nor a hard link already in the destination can redirect a write;
- count, per-file and total size are bounded while streaming: a tar bomb stops with an error and
  what was extracted until then stays.

Python's tarfile extraction filters are not used: several of their bypasses were fixed only in later
patch releases than the ones Debian ships.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

COPY_CHUNK = 256 * 1024


class UnsafeTar(ValueError):
    """The stream broke a rule or a bound; the message names the member and the rule."""


@dataclass(frozen=True)
class Limits:
    max_files: int = 10_000
    max_file_bytes: int = 1024**3
    max_total_bytes: int = 2 * 1024**3
    max_name_bytes: int = 1024
    max_depth: int = 32


@dataclass
class Extracted:
    files: list[tuple[str, int]] = field(default_factory=list)  # (relative path, size)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name as given, why)
    total_bytes: int = 0  # of `files`, kept as they are added: re-summing per member is quadratic


def safe_name(raw: str, limits: Limits = Limits()) -> str:
    """`raw` as a normalised relative path ("" for the archive's root), or UnsafeTar saying why not."""
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise UnsafeTar(f"member {raw[:80]!r}: control characters in the name")
    if "\\" in raw:
        raise UnsafeTar(f"member {raw[:80]!r}: backslash in the name")
    encoded = raw.encode("utf-8", "surrogateescape")
    if len(encoded) > limits.max_name_bytes:
        raise UnsafeTar(f"member {raw[:80]!r}...: name longer than {limits.max_name_bytes} bytes")
    if raw.startswith("/"):
        raise UnsafeTar(f"member {raw[:80]!r}: absolute path")
    parts = [part for part in raw.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeTar(f"member {raw[:80]!r}: '..' in the path")
    if len(parts) > limits.max_depth:
        raise UnsafeTar(f"member {raw[:80]!r}: deeper than {limits.max_depth} directories")
    if any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in parts):
        raise UnsafeTar(f"member {raw[:80]!r}: a path component is longer than 255 bytes")
    return "/".join(parts)


def kind_error(member: tarfile.TarInfo) -> str | None:
    """Why a member is not something we write (None for regular files and directories)."""
    if member.issym() or member.islnk():
        return f"links are not allowed (link to {member.linkname[:200]!r})"
    if member.ischr() or member.isblk():
        return "a device"
    if member.isfifo():
        return "a fifo"
    if member.issparse():
        return "sparse files are not allowed"
    if not (member.isreg() or member.isdir()):
        return f"unsupported member type {member.type!r}"
    return None


def extract(
    stream: BinaryIO,
    dest: Path,
    limits: Limits = Limits(),
    refuse: Callable[[str, tarfile.TarInfo], str | None] = lambda name, member: None,
) -> Extracted:
    """Write the acceptable members of `stream` under the existing directory `dest`.

    Members with unsafe names or types, over the per-file size, refused by `refuse` (which returns a
    reason), or blocked by what is already in `dest` are skipped and listed with the reason. The
    stream itself being broken, or the count or total size going over the limits, raises UnsafeTar.
    """
    result = Extracted()
    dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            for count, member in enumerate(archive, start=1):
                if count > limits.max_files:
                    raise UnsafeTar(f"more than {limits.max_files} entries: stopped extracting")
                if member.isfile() and result.total_bytes + member.size > limits.max_total_bytes:
                    raise UnsafeTar(f"files exceed {limits.max_total_bytes} bytes in total: stopped extracting")
                _extract_member(archive, member, dest_fd, limits, refuse, result)
    except tarfile.TarError as exc:
        raise UnsafeTar(f"not a valid tar stream: {exc}") from exc
    finally:
        os.close(dest_fd)
    return result


def _extract_member(archive, member, dest_fd, limits, refuse, result: Extracted) -> None:
    try:
        name = safe_name(member.name, limits)
    except UnsafeTar as exc:
        result.skipped.append((member.name[:300], str(exc)))
        return
    if not name:
        return  # the archive's own root
    why = kind_error(member) or refuse(name, member)
    if why is None and member.isfile() and member.size > limits.max_file_bytes:
        why = f"larger than {limits.max_file_bytes} bytes"
    if why is not None:
        if not member.isdir():  # a refused directory is only a parent of refused files
            result.skipped.append((name, why))
        return
    try:
        if member.isdir():
            os.close(open_dirs(dest_fd, name.split("/")))
            return
        source = archive.extractfile(member)
        assert source is not None  # regular members always have data
        _write_file(dest_fd, name, source, member.size, 0o755 if member.mode & 0o111 else 0o644)
    except OSError as exc:
        result.skipped.append((name, _why(exc)))
        return
    result.files.append((name, member.size))
    result.total_bytes += member.size


def open_dirs(dest_fd: int, parts: list[str]) -> int:
    """Open (creating) nested directories below dest_fd without following any symlink; an fd."""
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


def copy_exact(source: BinaryIO, out: BinaryIO, size: int) -> None:
    left = size
    while left:
        chunk = source.read(min(COPY_CHUNK, left))
        if not chunk:
            raise UnsafeTar("the stream ended inside a file")
        out.write(chunk)
        left -= len(chunk)


def _write_file(dest_fd: int, name: str, source: BinaryIO, size: int, mode: int) -> None:
    *dirs, base = name.split("/")
    dir_fd = open_dirs(dest_fd, dirs)
    tmp = f".{base[:200]}.mvc-{secrets.token_hex(6)}"
    try:
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(out_fd, "wb") as out:
                copy_exact(source, out, size)
                os.fchmod(out.fileno(), mode)
            _replace_regular(dir_fd, tmp, base)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)


def _replace_regular(dir_fd: int, tmp: str, base: str) -> None:
    try:
        existing = os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        raise OSError(errno.EEXIST, "exists in the destination and is not a regular file")
    os.replace(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a parent in the destination is a symlink or not a directory"
    return exc.strerror or str(exc)
