"""Running code inside a named network namespace without a subprocess.

setns(2) changes the namespace of the calling thread only, so each call runs in a fresh thread
that enters the namespace and dies afterwards: the caller's own namespace never changes. Sockets
and child processes created there stay in that namespace for their whole life.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pyroute2 import netns as pr_netns

from runner.errors import NetworkError

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

T = TypeVar("T")


class NetnsError(NetworkError):
    """A namespace operation failed; the message names the namespace."""


def path(name: str) -> Path:
    return NETNS_DIR / name


def exists(name: str) -> bool:
    return path(name).exists()


def create(name: str) -> None:
    try:
        pr_netns.create(name)
    except OSError as exc:
        raise NetnsError(f"cannot create network namespace {name}: {exc}") from exc


def remove(name: str) -> None:
    """Remove the namespace; a missing one is already what we want."""
    if not exists(name):
        return
    try:
        pr_netns.remove(name)
    except FileNotFoundError:
        pass


def names() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []


def _enter(name: str) -> None:
    fd = os.open(path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetnsError(f"cannot enter network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def enter(name: str) -> None:
    """Move the calling thread into namespace `name` for good: only for a thread of one's own that
    ends when its work there is done (every socket it then creates lives in `name`)."""
    _enter(name)


def run_in(name: str, fn: Callable[[], T]) -> T:
    """Call `fn` inside namespace `name` and return its result (or raise its exception)."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            _enter(name)
            result.append(fn())
        except BaseException as exc:  # handed back to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name=f"netns:{name}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def socket_in(name: str, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket that lives in namespace `name` for its whole life."""
    return run_in(name, lambda: socket.socket(family, kind, proto))
