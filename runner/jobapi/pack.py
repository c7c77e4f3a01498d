"""Packs the checkout as a streamed tar for the guest, carrying no credential of the host.

What goes in: regular files, directories and symlinks whose target resolves inside the checkout
(resolved component by component as the guest will, so `a -> .` followed by `a/../x` is caught).
What stays out: every `.git` (actions/checkout leaves the job token in `.git/config` as an
`http.<url>.extraheader`, and submodules keep their own configs), unless `include_git` asks for a
sanitised copy of the top-level one: objects, refs and the index, plus a config rebuilt from scratch
with only the repository format and the remotes' URLs stripped of user info. Sockets, FIFOs and
devices are skipped with a warning. The archive is generated chunk by chunk: a file is never held
whole in memory, so the checkout's size does not matter to the runner host.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit, urlunsplit

from runner.errors import ArchiveError

log = logging.getLogger(__name__)

CHUNK = 256 * 1024
MAX_LINK_HOPS = 40
# Parts of a .git directory that a guest needs for `git log/diff/status`; everything else (config,
# hooks, logs, FETCH_HEAD with remote URLs, modules/ with submodule configs, info/) stays behind.
GIT_KEEP = ("HEAD", "index", "packed-refs", "shallow", "ORIG_HEAD", "refs", "objects")
GIT_CONFIG_KEEP = ("core.repositoryformatversion", "extensions.objectformat")


class PackError(ArchiveError):
    """The checkout cannot be packed safely; the message names the offending path."""


@dataclass(frozen=True)
class Entry:
    """One archive member: `source` on the host, `name` inside the archive."""

    source: Path
    name: str
    kind: str  # "dir", "file", "symlink", "data"
    target: str = ""  # symlink target, relative
    data: bytes = b""  # generated content (the rebuilt .git/config)


def pack_checkout(root: Path, *, include_git: bool = False) -> Iterator[bytes]:
    """Yield the checkout under `root` as a POSIX (pax) tar stream, in chunks.

    Raises PackError before yielding anything when the tree holds a link that escapes the checkout,
    so a refused checkout never reaches the service half-sent.
    """
    root = Path(os.path.abspath(root))
    if not root.is_dir():
        raise PackError(f"checkout directory {root} does not exist")
    entries = list(_walk(root, include_git))
    return _stream(entries)


def _stream(entries: list[Entry]) -> Iterator[bytes]:
    for entry in entries:
        yield from _member(entry)
    yield tarfile.NUL * (2 * tarfile.BLOCKSIZE)


def _walk(root: Path, include_git: bool) -> Iterator[Entry]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = here / name
            rel = path.relative_to(root).as_posix()
            if name == ".git":
                if name in dirnames:
                    dirnames.remove(name)
                if include_git and here == root:
                    yield from _sanitised_git(root, path)
                continue
            yield from _entry(root, path, rel, dirnames)


def _entry(root: Path, path: Path, rel: str, dirnames: list[str]) -> Iterator[Entry]:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if path.name in dirnames:
            dirnames.remove(path.name)  # os.walk lists links to dirs as dirs; never descend
        yield Entry(path, rel, "symlink", target=_checked_link(root, path, rel))
    elif stat.S_ISDIR(st.st_mode):
        yield Entry(path, rel, "dir")
    elif stat.S_ISREG(st.st_mode):
        yield Entry(path, rel, "file")
    else:
        log.warning("skipping %s: not a regular file, directory or symlink", rel)


def _checked_link(root: Path, path: Path, rel: str) -> str:
    """The link's target, relative, if it resolves inside the checkout; PackError otherwise."""
    target = os.readlink(path)
    if os.path.isabs(target):
        inside = os.path.relpath(target, root)
        if inside == ".." or inside.startswith("../"):
            raise PackError(f"symlink {rel} points outside the checkout (to {target}): remove it or "
                            "make it point inside the checkout")
        target = os.path.relpath(os.path.join(root, inside), path.parent)
    _resolve_inside(root, PurePosixPath(rel).parent.parts, target, rel)
    return target


def _resolve_inside(root: Path, base: tuple[str, ...], target: str, rel: str) -> None:
    """Resolve `target` from directory `base` like the kernel would, never leaving `root`."""
    stack = list(base)
    todo = list(PurePosixPath(target).parts)
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "/" or part == "..":
            if part == "/" or not stack:
                raise PackError(f"symlink {rel} points outside the checkout (via {target}): remove it "
                                "or make it point inside the checkout")
            stack.pop()
            continue
        stack.append(part)
        current = root.joinpath(*stack)
        if current.is_symlink():
            hops += 1
            if hops > MAX_LINK_HOPS:
                raise PackError(f"symlink {rel} has too many levels of links")
            stack.pop()
            link = os.readlink(current)
            if os.path.isabs(link):
                stack, link = [], os.path.relpath(link, root)
            todo = list(PurePosixPath(link).parts) + todo


def _sanitised_git(root: Path, git: Path) -> Iterator[Entry]:
    if not git.is_dir() or git.is_symlink():
        raise PackError(f"{git} is not a directory (a worktree or submodule checkout?): "
                        "include-git needs a plain .git directory")
    yield Entry(git, ".git", "dir")
    yield Entry(git / "config", ".git/config", "data", data=_minimal_git_config(git / "config"))
    for keep in GIT_KEEP:
        path = git / keep
        if not os.path.lexists(path):
            continue
        if path.is_symlink():
            raise PackError(f".git/{keep} is a symlink: refusing to follow it out of the checkout")
        if path.is_dir():
            yield Entry(path, f".git/{keep}", "dir")
            yield from _git_tree(root, path)
        elif path.is_file():
            yield Entry(path, f".git/{keep}", "file")


def _git_tree(root: Path, top: Path) -> Iterator[Entry]:
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel == ".git/objects/info/alternates":
                continue  # would point the guest at object stores outside the checkout
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                yield Entry(path, rel, "dir")
            elif stat.S_ISREG(st.st_mode):
                yield Entry(path, rel, "file")
            else:
                if name in dirnames:
                    dirnames.remove(name)
                log.warning("skipping %s: only plain files and directories are kept in .git", rel)


def _minimal_git_config(config: Path) -> bytes:
    """A config holding only the repository format and credential-free remote URLs."""
    values = _read_git_config(config) if config.is_file() else []
    lines = ["[core]", "\tbare = false"]
    kept = dict((key, value) for key, value in values if key in GIT_CONFIG_KEEP)
    lines.append(f"\trepositoryformatversion = {_config_word(kept.get('core.repositoryformatversion', '0'))}")
    if "extensions.objectformat" in kept:
        lines += ["[extensions]", f"\tobjectformat = {_config_word(kept['extensions.objectformat'])}"]
    for key, value in values:
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "remote" and parts[2] == "url":
            remote = parts[1]
            if not remote.replace("-", "").replace("_", "").isalnum():
                continue
            url = strip_credentials(value)
            if not url:
                continue
            lines += [f'[remote "{remote}"]', f"\turl = {_config_word(url)}",
                      f"\tfetch = +refs/heads/*:refs/remotes/{remote}/*"]
    return ("\n".join(lines) + "\n").encode()


def host_git(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    """Run git on the host against a checkout a fork controls, giving that checkout no say.

    Started from `/` (no repository discovery in the workspace), with the system and global
    configs ignored and with the hooks, fsmonitor and pager that a checkout's `.git/config` could
    name switched off, so the command reads what it is asked and executes nothing of the fork's.
    """
    git = shutil.which("git", path="/usr/local/bin:/usr/bin:/bin")
    if git is None:
        raise FileNotFoundError("git")
    env = {"PATH": "/usr/bin:/bin", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_TERMINAL_PROMPT": "0", "HOME": "/nonexistent"}
    safe = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", "core.pager=cat"]
    return subprocess.run([git, *safe, *args], capture_output=True, check=True, timeout=timeout, cwd="/", env=env)


def _read_git_config(config: Path) -> list[tuple[str, str]]:
    # `git config --file` never follows include.path, so only this file is read.
    try:
        out = host_git("config", "--file", str(config), "--null", "--list").stdout
    except FileNotFoundError as exc:
        raise PackError("include-git needs git on the runner host to read .git/config") from exc
    except subprocess.CalledProcessError as exc:
        raise PackError(f"cannot read {config}: {exc.stderr.decode(errors='replace').strip()}") from exc
    pairs = []
    for item in out.split(b"\0"):
        key, _, value = item.decode(errors="replace").partition("\n")
        if key:
            pairs.append((key.lower(), value))
    return pairs


def _config_word(value: str) -> str:
    """Quote a config value so that it cannot start a new line or section."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "").replace("\r", "")
    return f'"{escaped}"'


def strip_credentials(url: str) -> str:
    """A remote URL without user info, query or fragment (where tokens hide); scp-style kept."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return ""
    if not parts.netloc:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if port:
        host = f"{host}:{port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _member(entry: Entry) -> Iterator[bytes]:
    info = tarfile.TarInfo(entry.name)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if entry.kind == "data":
        info.size, info.mode, info.mtime = len(entry.data), 0o644, 0
        yield info.tobuf(tarfile.PAX_FORMAT)
        yield entry.data + _padding(len(entry.data))
        return
    st = os.lstat(entry.source)
    info.mtime = int(st.st_mtime)
    if entry.kind == "dir":
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        yield info.tobuf(tarfile.PAX_FORMAT)
    elif entry.kind == "symlink":
        info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o777, entry.target
        yield info.tobuf(tarfile.PAX_FORMAT)
    else:
        yield from _file_member(entry, info)


def _file_member(entry: Entry, info: tarfile.TarInfo) -> Iterator[bytes]:
    # O_NOFOLLOW: a file swapped for a symlink after the walk is refused, not followed.
    try:
        fd = os.open(entry.source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PackError(f"cannot read {entry.name}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PackError(f"{entry.name} changed type while packing")
        info.size = st.st_size
        info.mode = 0o755 if st.st_mode & 0o111 else 0o644
        yield info.tobuf(tarfile.PAX_FORMAT)
        left = info.size
        while left:
            chunk = handle.read(min(CHUNK, left))
            if not chunk:
                raise PackError(f"{entry.name} shrank while packing: retry when nothing writes to it")
            left -= len(chunk)
            yield chunk
        yield _padding(info.size)


def _padding(size: int) -> bytes:
    return tarfile.NUL * (-size % tarfile.BLOCKSIZE)
