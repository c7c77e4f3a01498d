"""Runners that end before they take a job: retried with back-off, and a crash loop said out loud.

A fleet whose runners cannot start (an installation the walls hide, a release that does not run, a hook
interpreter that is not there) would otherwise start the next runner the moment the last one exits, for
ever, with jobs pending and nothing in `status` or the log saying why. So each runner that ends on its
own before its hook reported a job is a failed start: the next start waits RETRY_FIRST_SECONDS, doubled
for each such runner in a row up to RETRY_MAX_SECONDS, and from CRASH_LOOP_TRIES in a row on the fleet
reports a crash loop (`status`, the log, the metrics) with the last runner's exit status and the last
lines it printed. A runner that takes a job ends the run.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

CRASH_LOOP_TRIES = 3
RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 300.0
OUTPUT_BYTES = 2048  # how much of the end of a runner's output is read
OUTPUT_LINES = 5
LINE_CHARS = 200


def retry_delay(in_a_row: int) -> float:
    """How long the next start waits after `in_a_row` (1 or more) runners in a row failed to start."""
    return min(RETRY_FIRST_SECONDS * 2.0 ** min(in_a_row - 1, 32), RETRY_MAX_SECONDS)


def exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def last_output(fd: int) -> tuple[str, ...]:
    """The last lines a runner printed to its stdout and stderr (the file behind `fd`, which the fleet
    opened and kept: the runner may rename or replace its name, not this). The runner wrote them, and
    they are shown in `status` and the log: printable characters only, each line and their number bounded."""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, OUTPUT_BYTES, max(0, size - OUTPUT_BYTES))
    except OSError as exc:
        return (f"(its output could not be read: {exc.strerror})",)
    lines = ("".join(c if c.isprintable() else "?" for c in line.replace("\t", " ")).strip()
             for line in data.decode("utf-8", "replace").splitlines())
    return tuple(line[:LINE_CHARS] for line in lines if line)[-OUTPUT_LINES:]


@dataclass(frozen=True)
class StartFailure:
    """A runner that ended on its own before it took a job."""

    runner: str
    exit_code: int
    started_at: float
    ended_at: float
    output: tuple[str, ...]

    def describe(self) -> str:
        said = " | ".join(self.output) if self.output else "(nothing)"
        return (f"runner {self.runner} ended ({exit_text(self.exit_code)}) "
                f"{self.ended_at - self.started_at:.1f} s after its start, before taking a job; its last output: {said}")


class StartFailures:
    """The fleet's failed starts: in a row (for the back-off and the crash loop) and in all (the metrics).
    The fleet's thread notes failures; the service's thread notes a runner taking a job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_a_row = 0
        self.total = 0
        self.last: StartFailure | None = None

    def failed(self, failure: StartFailure) -> float:
        """Note a failed start; how long the next start must wait."""
        with self._lock:
            self.in_a_row += 1
            self.total += 1
            self.last = failure
            return retry_delay(self.in_a_row)

    def took_job(self) -> None:
        """A runner took a job: runners do start, whatever failed before."""
        with self._lock:
            self.in_a_row = 0

    def crash_loop(self, next_try_at: float) -> dict[str, Any] | None:
        """The report while CRASH_LOOP_TRIES or more runners in a row failed to start, else None."""
        with self._lock:
            last, tries = self.last, self.in_a_row
        if last is None or tries < CRASH_LOOP_TRIES:
            return None
        return {"tries": tries, "runner": last.runner, "exit_code": last.exit_code, "exit": exit_text(last.exit_code),
                "lived_seconds": round(last.ended_at - last.started_at, 1), "ended_at": last.ended_at,
                "output": list(last.output), "next_try_at": next_try_at,
                "reason": f"crash loop: {tries} runners in a row ended before taking a job; the last: {last.describe()}"}
