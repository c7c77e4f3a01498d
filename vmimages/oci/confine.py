"""The helper programs that touch image bytes (skopeo, zstd), run confined: an absolute path found once,
a minimal environment of our making (none of the caller's proxy or credential variables), an unprivileged
uid when the host runs as root, a process group of their own that a timeout or a bound kills whole.

Why a uid of nobody's: skopeo parses a registry's answers and zstd a layer's frames; a bug in either must
not be a root shell on the build host. The files such a process writes are made root's before they are
read (see fetch.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO

from runner.errors import ImageError

SEARCH_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
UNPRIVILEGED = 65534  # nobody/nogroup
PACKAGES = {"skopeo": "skopeo", "zstd": "zstd", "setpriv": "util-linux"}
STDERR_TAIL = 2000


@cache
def tool(name: str) -> str:
    """The absolute path of a helper program, looked up once in the system directories only (never the
    caller's PATH)."""
    found = shutil.which(name, path=SEARCH_PATH)
    if found is None:
        raise ImageError(f"{name} is not installed: install Debian's {PACKAGES.get(name, name)} package "
                         "(scripts/setup does)")
    return found


def as_unprivileged() -> list[str]:
    """The argv prefix that drops to uid/gid 65534 with no groups, capabilities or new privileges when we run
    as root; nothing otherwise (the process then runs as our own unprivileged user)."""
    if os.geteuid() != 0:
        return []
    return [tool("setpriv"), f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def helper_uid() -> int:
    """The uid the helpers' files are owned by while they write them."""
    return UNPRIVILEGED if os.geteuid() == 0 else os.geteuid()


def minimal_env(home: Path, **extra: str) -> dict[str, str]:
    """The whole environment a helper gets: a PATH of system directories, HOME (and TMPDIR) in our own work
    directory, a C locale, and `extra`. Nothing of ours leaks in (proxies, tokens, DOCKER_CONFIG, ...)."""
    return {"PATH": SEARCH_PATH, "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8", **extra}


@dataclass(frozen=True)
class Finished:
    """A helper that ran to its end: its exit status and the tail of what it printed on stderr."""

    returncode: int
    stderr: str


def run(argv: Sequence[str], *, env: dict[str, str], cwd: Path, timeout: float, stdout: Path | None = None,
        watch: Callable[[], str | None] = lambda: None, what: str) -> Finished:
    """Run `argv` to its end, killed as a group after `timeout` seconds or as soon as `watch` (called about
    twice a second) returns a reason. stdout goes to the new file `stdout` (or nowhere), stderr to an unnamed
    temporary file whose tail is kept for the error message. Both are created by us, never through a name
    that is already there: a helper's directories are writable by its uid, so a link there is not ours."""
    out_file = _new_file(stdout, what) if stdout is not None else open(os.devnull, "wb")
    with out_file, tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file, env=env,
                                cwd=cwd, start_new_session=True, close_fds=True)
        stopped = _wait(proc, timeout, watch)
        err_file.seek(max(0, err_file.seek(0, os.SEEK_END) - STDERR_TAIL))
        tail = err_file.read().decode("utf-8", "replace").strip()
    if stopped:
        raise ImageError(f"{what}: {stopped}" + (f"; it said: {tail}" if tail else ""))
    return Finished(proc.returncode, tail)


def _new_file(path: Path, what: str) -> BinaryIO:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ImageError(f"{what}: cannot create {path} for its output ({exc.strerror}): refused") from None
    return os.fdopen(fd, "wb")


def _wait(proc: subprocess.Popen[bytes], timeout: float, watch: Callable[[], str | None]) -> str | None:
    """None once `proc` exits by itself; else why it was killed (with its whole group)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            return None
        except subprocess.TimeoutExpired:
            pass
        why = watch() or (f"killed after {timeout:g} seconds (the fetch timeout)" if time.monotonic() >= deadline
                          else None)
        if why:
            kill_group(proc)
            return why


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a helper started with start_new_session and everything it started, and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
