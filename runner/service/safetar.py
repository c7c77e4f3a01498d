"""Validation of tar streams that came out of a guest.

The guest is hostile, so its artifact tar is never handed to anyone as it is: every member is checked
(a plain relative path, a regular file or directory, bounded count and size) and the survivors are
re-written into a fresh tar with neutral metadata. A single bad member rejects the whole archive,
because a partial set of artifacts would silently look like a complete one.
"""

from __future__ import annotations

import posixpath
import tarfile
from dataclasses import dataclass
from typing import BinaryIO

from runner.service.config import ArtifactLimits
from runner.tarsafe import UnsafeTar, kind_error, safe_name

ArchiveError = UnsafeTar  # the host's one error for a guest tar it refuses


@dataclass(frozen=True)
class Member:
    path: str
    size: int

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size}


def _check_type(info: tarfile.TarInfo) -> None:
    why = kind_error(info)
    if why is not None:
        raise ArchiveError(f"member {info.name!r}: {why}")


def copy_validated(src: BinaryIO, dst: BinaryIO, limits: ArtifactLimits) -> list[Member]:
    """Read a tar stream from `src`, write a clean tar of its files and directories to `dst`.

    Returns the regular files written. Raises ArchiveError on the first member that is not a plain
    file or directory under a safe relative path, on duplicate names, or when the count or total size
    goes over `limits`; `dst` then holds garbage and the caller discards it.
    """
    files: list[Member] = []
    seen: set[str] = set()
    file_names: set[str] = set()
    total = 0
    count = 0
    try:
        source = tarfile.open(fileobj=src, mode="r|", errorlevel=2)
    except tarfile.TarError as exc:
        raise ArchiveError(f"not a tar stream: {exc}") from exc
    with source, tarfile.open(fileobj=dst, mode="w|", format=tarfile.PAX_FORMAT) as out:
        try:
            for info in source:
                _check_type(info)
                name = safe_name(info.name)
                if not name:
                    continue  # "." : the archive's own root
                if name in seen:
                    raise ArchiveError(f"member {name!r}: appears twice")
                seen.add(name)
                count += 1
                if count > limits.max_count:
                    raise ArchiveError(f"more than {limits.max_count} members")
                if _parent_is_file(name, file_names):
                    raise ArchiveError(f"member {name!r}: its parent is a file")
                clean = tarfile.TarInfo(name)
                clean.mtime = max(0, min(int(info.mtime), 2**33))
                if info.isdir():
                    clean.type, clean.mode = tarfile.DIRTYPE, 0o755
                    out.addfile(clean)
                    continue
                total += info.size
                if total > limits.max_total_bytes:
                    raise ArchiveError(f"member {name!r}: artifacts larger than {limits.max_total_bytes} bytes in total")
                clean.size, clean.mode = info.size, 0o755 if info.mode & 0o111 else 0o644
                data = source.extractfile(info)
                assert data is not None  # a regular file always has a reader
                out.addfile(clean, data)  # a short member raises ReadError ("unexpected end of data")
                files.append(Member(name, info.size))
                file_names.add(name)
        except tarfile.TarError as exc:
            raise ArchiveError(f"corrupt tar stream: {exc}") from exc
    return files


def _parent_is_file(name: str, file_names: set[str]) -> bool:
    parent = posixpath.dirname(name)
    while parent:
        if parent in file_names:
            return True
        parent = posixpath.dirname(parent)
    return False


def check_tar(src: BinaryIO) -> int:
    """Walk a tar stream's headers to reject garbage before a VM is spent on it; returns the member count.

    Headers are only counted: `TarFile` would otherwise keep every one (about 0.4 KiB each), and a
    checkout of empty files within the size limit has millions of them.
    """
    count = 0
    try:
        with tarfile.open(fileobj=src, mode="r:", errorlevel=2) as tar:
            while tar.next() is not None:
                count += 1
                tar.members.clear()
    except tarfile.TarError as exc:
        raise ArchiveError(f"not a valid tar archive: {exc}") from exc
    return count
