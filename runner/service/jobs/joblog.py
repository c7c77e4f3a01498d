"""A job's log: append-only NDJSON on disk, followed live by any number of readers.

The file holds exactly the lines the API serves, so a follower copies bytes instead of re-encoding,
and a finished job's log survives a service restart. Guest output is untrusted and unbounded, and
what it costs is disk, kept for the retention period: so the budget `max_bytes` counts the bytes of
its entries as written (JSON and base64 included), not the guest's bytes, and a write that would
pass it writes what fits, a system note, and raises `LogFull` so the caller stops the command.
Small writes are merged into larger entries before they get here (`runner.vm.agent`), which is
what keeps an entry's fixed overhead from multiplying a byte-at-a-time writer's output. Memory use
is one entry at a time whatever the guest writes.

Beside it, the job's terminal transcript (`Transcript`, issue 37): everything its attached sessions
(runner/service/api/attach.py) sent and received, in the job's directory beside its log, pruned with it.

NDJSON, one entry per chunk: `{"session": n, "dir": "in"|"out", "ts": …, "data": base64}` for what the
operator typed (in) and the guest's output as it came (out, before the terminal filter: the record is of
what the guest did), and `{"session": n, "dir": "note", …}` for the service's own lines (attached by,
ended). Bounded like the log: at most `max_bytes` on disk (the log's `logs.max_bytes`), entries of at most
`max_entry_bytes`; past the budget what fits is written, then one note says the transcript was cut, and
nothing more of any session is kept (the sessions go on). Whoever shows it neutralises the guest's bytes
for where they go (`shown_lines`: no escape sequence, no control, for a terminal and for HTML alike).
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from runner.errors import SandboxError
from runner.service.config.settings import LogLimits


class LogFull(SandboxError):
    """The job's output reached its log budget on disk: the command must be stopped."""


class JobLog:
    def __init__(self, path: Path, limits: LogLimits, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.limits = limits
        self._clock = clock
        self._cond = threading.Condition()
        self._file: BinaryIO | None = open(self.path, "ab")  # None in a `finished` (read-only) log
        self._size = self._file.tell()
        self._seq = _count_lines(self.path) if self._size else 0
        self._output_bytes = 0  # on disk, for guest output: what the budget counts
        self._full: str | None = None
        self._closed = False
        self._watchers: list[Callable[[], None]] = []  # told of every commit and the close (LogCursor.watch)

    @classmethod
    def finished(cls, path: Path) -> JobLog:
        """A read-only view of a log written earlier (possibly by a previous service process)."""
        log = cls.__new__(cls)
        log.path = Path(path)
        log._cond = threading.Condition()
        log._file = None
        log._size = log.path.stat().st_size if log.path.exists() else 0
        log._closed = True
        log._watchers = []
        return log

    @property
    def output_bytes(self) -> int:
        """Bytes of guest output entries written to the file so far (the budget's measure)."""
        return self._output_bytes

    def append(self, stream: str, data: bytes) -> None:
        """Record guest output, split into entries of at most `max_entry_bytes`.

        Raises LogFull once the entries would pass the job's budget on disk (after writing the
        part that fits and a note), and on every later call: the caller must stop the command.
        """
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"unknown stream {stream!r}")
        with self._cond:
            if self._closed:
                return
            try:
                step = self.limits.max_entry_bytes
                for start in range(0, len(data), step):
                    self._write_output(stream, data[start : start + step])
            finally:
                self._commit()

    def _write_output(self, stream: str, data: bytes) -> None:
        if self._full is not None:
            raise LogFull(self._full)
        ts = self._clock()
        line = self._line(stream, data, ts)
        room = self.limits.max_bytes - self._output_bytes
        if len(line) <= room:
            self._put_output(line)
            return
        fits = _fitting_bytes(len(line) - _b64_size(len(data)), room)
        if fits > 0:
            self._put_output(self._line(stream, data[:fits], ts))
        self._full = (f"the command's output reached the log limit of {self.limits.max_bytes} bytes on disk "
                      "(logs.max_bytes): the command was stopped")
        self._put(self._line("system", self._full.encode(), ts))
        raise LogFull(self._full)

    def _put_output(self, line: bytes) -> None:
        self._put(line)
        self._output_bytes += len(line)

    def system(self, text: str) -> None:
        """A note from the service itself (not counted against the guest's budget)."""
        with self._cond:
            if self._closed:
                return
            self._put(self._line("system", text.encode()[: self.limits.max_entry_bytes], self._clock()))
            self._commit()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._commit()
            self._writer().close()
            self._closed = True
            self._cond.notify_all()
            self._tell_watchers()

    def _line(self, stream: str, data: bytes, ts: float) -> bytes:
        """The entry that `_put` would write next."""
        entry = {"seq": self._seq + 1, "stream": stream, "ts": ts, "data": base64.b64encode(data).decode()}
        return json.dumps(entry, separators=(",", ":")).encode() + b"\n"

    def _put(self, line: bytes) -> None:
        self._seq += 1
        self._writer().write(line)

    def _commit(self) -> None:
        writer = self._writer()
        writer.flush()
        self._size = writer.tell()
        self._cond.notify_all()
        self._tell_watchers()

    def _tell_watchers(self) -> None:
        for wake in self._watchers:
            wake()  # the stream thread's poke: a set add and a pipe write, never blocking

    def watch(self, wake: Callable[[], None]) -> None:
        with self._cond:
            self._watchers.append(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        with self._cond:
            if wake in self._watchers:
                self._watchers.remove(wake)

    def _writer(self) -> BinaryIO:
        """The open file; only a log this process writes has one, and it writes only until closed."""
        assert self._file is not None, f"{self.path}: a finished log is read-only"
        return self._file

    def follow(self, after: int = 0, poll_seconds: float = 1.0, wait: bool = True) -> Iterator[bytes]:
        """Yield NDJSON lines (with their newline) with seq > `after`, live, until the log is closed
        (`wait=False`: only the lines committed so far)."""
        seq = 0
        if self._closed and not self.path.exists():
            return  # a job that ended before it wrote anything, or whose directory was pruned
        with open(self.path, "rb") as f:
            while True:
                with self._cond:
                    while wait and f.tell() >= self._size and not self._closed:
                        self._cond.wait(poll_seconds)
                    size, closed = self._size, self._closed
                while f.tell() < size:
                    line = f.readline(size - f.tell())
                    if not line.endswith(b"\n"):
                        break  # only committed bytes are read, so this is a torn file from a crash
                    seq += 1
                    if seq > after:
                        yield line
                if closed or f.tell() < size or not wait:
                    return

    def cursor(self, after: int = 0, wait: bool = True) -> LogCursor:
        """A non-blocking reader of the lines with seq > `after` (for the API's stream thread); `wait=False`
        ends it at the lines committed by its first read, as `follow(wait=False)`."""
        return LogCursor(self, after, wait=wait)

    def committed(self) -> tuple[int, bool]:
        """Bytes written whole so far, and whether the log is closed (no more will come)."""
        with self._cond:
            return self._size, self._closed


class LogCursor:
    """What `follow` yields, without waiting: each `read` returns the whole lines committed since the
    last one (at most about `limit` bytes), and whether the log has ended after them. The file is open
    only during a read, so a follower that waits costs no fd."""

    def __init__(self, log: JobLog, after: int = 0, limit: int = 1024 * 1024, wait: bool = True) -> None:
        self._log, self._after, self._limit = log, after, limit
        self._offset = 0
        self._seq = 0
        self._until: int | None = None if wait else log.committed()[0]

    def watch(self, wake: Callable[[], None]) -> None:
        """`wake` is called whenever more may be read (a commit, the close)."""
        self._log.watch(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        self._log.unwatch(wake)

    def read(self) -> tuple[list[bytes], bool]:
        size, closed = self._log.committed()
        if self._until is not None:
            size, closed = min(size, self._until), True
        if self._offset >= size:
            return [], closed
        try:
            with open(self._log.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(min(size - self._offset, self._limit))
        except FileNotFoundError:
            return [], True  # pruned meanwhile
        end = chunk.rfind(b"\n") + 1
        if end == 0:  # no whole line: a torn file from a crash, or (limit-sized) an entry past any budget
            return [], closed or len(chunk) >= self._limit
        lines = []
        for line in chunk[:end].splitlines(keepends=True):
            self._seq += 1
            if self._seq > self._after:
                lines.append(line)
        self._offset += end
        return lines, closed and self._offset >= size


def _b64_size(n: int) -> int:
    return 4 * ((n + 2) // 3)


def _fitting_bytes(overhead: int, room: int) -> int:
    """The most bytes whose entry (fixed `overhead` plus base64) takes at most `room` bytes."""
    return max(0, (room - overhead) // 4 * 3)


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


TRANSCRIPT = "terminal.ndjson"  # in the job's directory
DIRECTIONS = ("in", "out", "note")
MAX_LINE = 64 * 1024  # a line longer is shown in pieces
_NOTE_ROOM = 512  # kept for the note that says the transcript was cut
# What showing a transcript removes of the guest's bytes: every escape sequence (CSI, OSC/DCS/APC/PM/SOS
# strings to their terminator or the end, two- and three-character escapes), then every control left but
# newline and tab. A carriage return before a newline is the terminal's line end; any other ends a line too.
_SEQUENCES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b[P\]_^X][^\x07\x1b]*(?:\x07|\x1b\\|$)|\x1b[ -/]*[0-~]?"
                        r"|[\x9b][0-?]*[ -/]*[@-~]?|[\x90\x9d\x9e\x9f\x98][^\x07\x1b\x9c]*(?:\x07|\x9c|\x1b\\|$)")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class Transcript:
    """The job's transcript file, written by any number of sessions at once (one lock)."""

    def __init__(self, job_dir: Path, limits: LogLimits) -> None:
        self.path = job_dir / TRANSCRIPT
        self._limits = limits
        self._lock = threading.Lock()
        self._size = self.path.stat().st_size if self.path.exists() else 0
        self._cut = False

    def note(self, session: int, text: str) -> None:
        self.write(session, "note", text.encode()[:1024])

    def write(self, session: int, direction: str, data: bytes) -> None:
        """Keep a chunk (split into entries); past the budget, what fits and then the one note."""
        if direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {direction!r}")
        if not data:
            return
        step = self._limits.max_entry_bytes
        with self._lock:
            for start in range(0, len(data), step):
                if not self._put(session, direction, data[start:start + step]):
                    return

    def _put(self, session: int, direction: str, data: bytes) -> bool:
        if self._cut:
            return False
        room = self._limits.max_bytes - self._size - _NOTE_ROOM  # the cut note fits after anything written
        entry = _entry(session, direction, data)
        if len(entry) <= room:
            self._append(entry)
            return True
        fits = max(0, (room - len(entry) + _b64_size(len(data))) // 4 * 3)
        if fits and direction != "note":
            self._append(_entry(session, direction, data[:fits]))
        self._cut = True
        note = _entry(session, "note", f"the transcript reached its limit of {self._limits.max_bytes} bytes "
                                       "(logs.max_bytes): nothing more of any session is kept".encode())
        if self._size + len(note) <= self._limits.max_bytes:  # not when an earlier process already wrote it
            self._append(note)
        return False

    def _append(self, line: bytes) -> None:
        with open(self.path, "ab") as f:
            f.write(line)
        self._size += len(line)


def _entry(session: int, direction: str, data: bytes) -> bytes:
    entry = {"session": session, "dir": direction, "ts": time.time(), "data": base64.b64encode(data).decode()}
    return json.dumps(entry, separators=(",", ":")).encode() + b"\n"


@dataclass(frozen=True)
class ShownLine:
    """One line of a transcript as shown: its session, direction, time and neutral text."""

    session: int
    dir: str
    ts: float
    text: str


def neutral(text: str) -> str:
    """Terminal bytes as inert text: no escape sequence, no control but newline and tab."""
    text = _SEQUENCES.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROLS.sub("", text)


def shown_lines(job_dir: Path) -> Iterator[ShownLine]:
    """The transcript's lines, neutralised, each session's input and output kept apart: a chunk that ends
    inside a line is continued by the next chunk of its session and direction (a sequence split between
    chunks is whole again before it is removed). Entries not of the service's own shape are skipped."""
    path = job_dir / TRANSCRIPT
    if not path.exists():
        return
    pending: dict[tuple[int, str], tuple[float, str]] = {}
    with open(path, "rb") as f:
        for raw in f:
            entry = _read(raw)
            if entry is None:
                continue
            session, direction, ts, data = entry
            text = data.decode("utf-8", "replace")
            if direction == "note":
                yield ShownLine(session, direction, ts, neutral(text).replace("\n", " "))
                continue
            first, held = pending.pop((session, direction), (ts, ""))
            text = held + text.replace("\r\n", "\n").replace("\r", "\n")
            end = text.rfind("\n")
            if end < 0 and len(text) < MAX_LINE:
                pending[session, direction] = (first, text)
                continue
            whole, rest = (text[:end], text[end + 1:]) if end >= 0 else (text, "")
            for number, line in enumerate(neutral(whole).split("\n")):
                yield ShownLine(session, direction, first if number == 0 else ts, line)
            if rest:
                pending[session, direction] = (ts, rest)
    for (session, direction), (ts, text) in pending.items():
        yield ShownLine(session, direction, ts, neutral(text))


def _read(raw: bytes) -> tuple[int, str, float, bytes] | None:
    try:
        entry = json.loads(raw)
        session, direction, ts = entry["session"], entry["dir"], entry["ts"]
        data = base64.b64decode(entry["data"], validate=True)
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(session, int) or direction not in DIRECTIONS or not isinstance(ts, (int, float)):
        return None
    return session, direction, float(ts), data
