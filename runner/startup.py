"""A program's long-lived start-up objects, kept out of the cyclic garbage collector's walks (issue 26).

Importing a command's area makes ~100k objects (the in-process service of `run`: several times that), none
of them garbage. The collector walked them during the imports and again and again afterwards, and the
interpreter's final collections walked them once more at exit: 20-30 ms of a `run -- true` through a
service, 60-70 ms of one without. So a process of its own (`begin`, from the installed command) keeps the
collector off while such objects are made and then freezes them (`gc.freeze`: moved where no collection
looks) before collecting as usual again. Anywhere else (a test calling `main` or `LocalRun`) nothing changes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_program = False


def begin() -> None:
    """This process is the command's own: the collector is off until `settled`."""
    global _program
    _program = True
    gc.disable()


def settled() -> None:
    """What exists now lives as long as the process: frozen, and collection resumes for what comes after."""
    if _program:
        gc.freeze()
        gc.enable()


@contextmanager
def long_lived() -> Iterator[None]:
    """A block whose objects live as long as the process (a service's imports and start): made with the
    collector off, frozen after."""
    if not _program or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        settled()
