"""Packing a local checkout for `microvm-check run`: a tar stream of the directory, minus `.git`.

The whole tree is checked before a byte is sent (and before a VM is spent): a symbolic link that
points outside the directory (or anywhere absolute) would hand the guest a path into the host's
layout, so it is refused, as are sockets, fifos and devices. The tar itself is produced on the fly
by a thread writing into a pipe, so a large checkout is never held in memory or copied to disk.
"""

from __future__ import annotations

import os
import stat
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

SKIPPED_DIRS = frozenset({".git"})
_CHUNK = 1024 * 1024


class PackError(ValueError):
    """The directory cannot be sent as it is; the message names the path."""


def scan(root: Path) -> list[Path]:
    """Every path to pack, relative to `root`, parents before children; PackError for what must not go."""
    root = root.resolve()
    if not root.is_dir():
        raise PackError(f"{root}: not a directory")
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        here = Path(dirpath)
        for name in dirnames + sorted(filenames):
            path = here / name
            _check(root, path)
            found.append(path.relative_to(root))
        # os.walk does not descend into symlinked directories, which is what we want: the link itself is packed
    return found


def _raise(exc: OSError) -> None:
    raise PackError(f"{exc.filename}: cannot read: {exc.strerror}")


def _check(root: Path, path: Path) -> None:
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode):
        target = os.readlink(path)
        if os.path.isabs(target):
            raise PackError(f"{path}: symbolic link to the absolute path {target!r}; make it relative or remove it")
        resolved = Path(os.path.normpath(path.parent / target))
        if resolved != root and root not in resolved.parents:
            raise PackError(f"{path}: symbolic link to {target!r} points outside {root}")
    elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise PackError(f"{path}: not a regular file, directory or link (a socket, fifo or device); remove it")


def stream(root: Path, paths: list[Path]) -> Iterator[bytes]:
    """A tar of `paths` (from `scan`) as chunks; errors in the writer thread are raised here."""
    root = root.resolve()
    read_fd, write_fd = os.pipe()
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            with os.fdopen(write_fd, "wb") as writer, tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for rel in paths:
                    info = tar.gettarinfo(str(root / rel), arcname=str(rel))
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    if info.isreg():
                        with open(root / rel, "rb") as f:
                            tar.addfile(info, f)
                    else:
                        tar.addfile(info)
        except BrokenPipeError:
            pass  # the reader stopped (the upload failed); its error is the one that matters
        except BaseException as exc:
            failure.append(exc)

    writer = threading.Thread(target=produce, name="pack", daemon=True)
    writer.start()
    with os.fdopen(read_fd, "rb") as reader:
        while chunk := reader.read(_CHUNK):
            yield chunk
    writer.join()
    if failure:
        raise PackError(f"packing {root} failed: {failure[0]}")
