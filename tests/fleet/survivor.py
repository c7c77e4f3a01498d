"""A job step that leaves a `setsid` child behind, and the host's view of that child.

A runner lives in its own PID namespace (runner/fleet/walls.py), so the pid a step prints with `$!`
is that namespace's, not the host's: pid 11 inside may be a kernel worker outside, and a test that
looked up the printed pid on the host checked the wrong process (a CI run failed on exactly that).
The child is found on the host by its command line instead, `sleep 600.<nonce>`, unique to one test,
while the step holds the job open for a second so that the watch sees it alive.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path
from types import TracebackType

from tests.procs import runs


class Survivor:
    """Watches the host's /proc, from before the job is queued until it is closed, for the child."""

    def __init__(self) -> None:
        self.marker = f"600.{secrets.randbelow(10**6):06d}"
        self.step = f"setsid sleep {self.marker} </dev/null >/dev/null 2>&1 & sleep 1"
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._scan, name="survivor-watch", daemon=True)

    def __enter__(self) -> Survivor:
        self._watch.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._watch.join()
        for pid in self.alive():  # only on failure: the test leaves nothing behind
            os.kill(pid, 9)

    def alive(self) -> list[int]:
        """The host pids of the child that still run (zombies count as gone)."""
        return [pid for pid in sorted(self.seen) if _runs(pid, self.marker)]

    def gone_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.alive()

    def _scan(self) -> None:
        while not self._stop.wait(0.02):
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit() and _runs(int(entry.name), self.marker):
                    self.seen.add(int(entry.name))


def _runs(pid: int, marker: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[:2] == [b"sleep", marker.encode()] and runs(pid)
