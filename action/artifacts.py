"""Copies the job's artifacts out of the service's tar stream into the workspace.

The service validates artifacts already, but their names and bytes come from the guest, so this side
checks again instead of trusting one layer, with the host's rules for guest tars (`runner.tarsafe`:
plain relative names, only files and directories, no write through a link already in the workspace,
bounded count and size), and takes only what matches the globs the workflow asked for.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from runner import tarsafe
from runner.tarsafe import Extracted as Extraction
from runner.tarsafe import Limits as ArtifactLimits

__all__ = ["ArtifactError", "ArtifactLimits", "BoundedWriter", "Extraction", "extract", "glob_regex", "matches"]


class ArtifactError(Exception):
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
