"""A job's log: append-only NDJSON on disk, followed live by any number of readers.

The file holds exactly the lines the API serves, so a follower copies bytes instead of re-encoding,
and a finished job's log survives a service restart. Guest output is untrusted and unbounded: the
log keeps at most `max_bytes` of it and then records, in a system entry, how much it dropped; memory
use is one entry at a time whatever the guest writes.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from runner.service.config import LogLimits


class JobLog:
    def __init__(self, path: Path, limits: LogLimits, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.limits = limits
        self._clock = clock
        self._cond = threading.Condition()
        self._file = open(self.path, "ab")
        self._size = self._file.tell()
        self._seq = _count_lines(self.path) if self._size else 0
        self._kept = 0
        self._dropped = 0
        self._closed = False

    @classmethod
    def finished(cls, path: Path) -> JobLog:
        """A read-only view of a log written earlier (possibly by a previous service process)."""
        log = cls.__new__(cls)
        log.path = Path(path)
        log._cond = threading.Condition()
        log._file = None
        log._size = log.path.stat().st_size if log.path.exists() else 0
        log._closed = True
        return log

    @property
    def dropped_bytes(self) -> int:
        return self._dropped

    def append(self, stream: str, data: bytes) -> None:
        """Record guest output; anything beyond the job's log budget is counted and dropped."""
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"unknown stream {stream!r}")
        with self._cond:
            if self._closed:
                return
            room = max(0, self.limits.max_bytes - self._kept)
            kept, dropped = data[:room], len(data) - min(len(data), room)
            step = self.limits.max_entry_bytes
            for start in range(0, len(kept), step):
                self._write(stream, kept[start : start + step])
            self._kept += len(kept)
            if dropped and not self._dropped:
                self._write("system", f"log limit of {self.limits.max_bytes} bytes reached: further output is dropped".encode())
            self._dropped += dropped
            self._commit()

    def system(self, text: str) -> None:
        """A note from the service itself (not counted against the guest's budget)."""
        with self._cond:
            if self._closed:
                return
            self._write("system", text.encode()[: self.limits.max_entry_bytes])
            self._commit()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            if self._dropped:
                self._write("system", f"{self._dropped} bytes of output were dropped".encode())
            self._commit()
            self._file.close()
            self._closed = True
            self._cond.notify_all()

    def _write(self, stream: str, data: bytes) -> None:
        self._seq += 1
        line = {"seq": self._seq, "stream": stream, "ts": self._clock(), "data": base64.b64encode(data).decode()}
        self._file.write(json.dumps(line, separators=(",", ":")).encode() + b"\n")

    def _commit(self) -> None:
        self._file.flush()
        self._size = self._file.tell()
        self._cond.notify_all()

    def follow(self, after: int = 0, poll_seconds: float = 1.0) -> Iterator[bytes]:
        """Yield NDJSON lines (with their newline) with seq > `after`, live, until the log is closed."""
        seq = 0
        if self._closed and not self.path.exists():
            return  # a job that ended before it wrote anything, or whose directory was pruned
        with open(self.path, "rb") as f:
            while True:
                with self._cond:
                    while f.tell() >= self._size and not self._closed:
                        self._cond.wait(poll_seconds)
                    size, closed = self._size, self._closed
                while f.tell() < size:
                    line = f.readline(size - f.tell())
                    if not line.endswith(b"\n"):
                        break  # only committed bytes are read, so this is a torn file from a crash
                    seq += 1
                    if seq > after:
                        yield line
                if closed or f.tell() < size:
                    return


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))

