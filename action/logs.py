"""Relays the guest's log stream into the Actions job log, live, without letting it speak to the runner.

Two independent layers keep guest output from acting as workflow commands:
1. the guest output sits between `::stop-commands::<token>` and `::<token>::`, with a fresh 128-bit
   token per job that is never sent to the guest, so while it prints, the runner processes no command;
2. every guest line is also neutralised on its own (`workflow.neutralise_line`), so even a guest that
   learnt the token could not resume command processing, and a mistake in one layer is not fatal.
Guest bytes are decoded incrementally per stream (UTF-8 split across chunks survives; invalid bytes
become U+FFFD), partial lines are held until they end, long lines are wrapped, and the total shown is
bounded so that a flood cannot exhaust the runner's log.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import TextIO

from runner.jobapi.workflow import neutralise_line, split_lines, stop_token


@dataclass(frozen=True)
class RelayLimits:
    """How much of the guest's log the relay shows in the Actions job log (the service bounds its own
    copy separately: runner.service.config.settings.LogLimits)."""

    max_bytes: int = 16 * 1024 * 1024  # guest bytes shown in the job log
    max_lines: int = 200_000
    max_line_chars: int = 8192  # longer lines are wrapped


@dataclass
class _Stream:
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    pending: str = ""


class LogRelay:
    """Writes guest log chunks to `out` inside a collapsed group with commands stopped.

    Use as a context manager: entering opens the group and stops commands, leaving flushes partial
    lines and resumes commands, even when the job is interrupted, so the rest of the step works.
    """

    def __init__(self, out: TextIO, title: str, limits: RelayLimits = RelayLimits()) -> None:
        self._out = out
        self._title = title
        self._limits = limits
        self._token = stop_token()
        self._streams: dict[str, _Stream] = {}
        self.shown_bytes = 0
        self.shown_lines = 0
        self.dropped_bytes = 0

    def __enter__(self) -> LogRelay:
        self._out.write(f"::group::{neutralise_line(self._title)}\n")
        self._out.write(f"::stop-commands::{self._token}\n")
        self._out.flush()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, stream in self._streams.items():
            tail = stream.pending + stream.decoder.decode(b"", final=True)
            stream.pending = ""
            if tail:
                self._emit(name, split_lines(tail))
        if self.dropped_bytes:
            self._out.write(
                f"[microvm-check] log truncated: {self.dropped_bytes} more bytes from the guest were not "
                f"shown (limit {self._limits.max_bytes} bytes / {self._limits.max_lines} lines)\n"
            )
        self._out.write(f"::{self._token}::\n")
        self._out.write("::endgroup::\n")
        self._out.flush()

    def feed(self, stream: str, data: bytes) -> None:
        """Relay one chunk of one stream ("stdout", "stderr" or "system")."""
        if self._full():
            self.dropped_bytes += len(data)
            return
        room = self._limits.max_bytes - self.shown_bytes
        if len(data) > room:
            self.dropped_bytes += len(data) - room
            data = data[:room]
        self.shown_bytes += len(data)
        if stream == "system" and not data.endswith(b"\n"):
            data += b"\n"  # the service's own messages are whole lines
        state = self._streams.setdefault(stream, _Stream())
        text = state.pending + state.decoder.decode(data)
        # Hold a trailing \r back: it may be the first half of a \r\n split across chunks.
        hold_cr = text.endswith("\r")
        lines = split_lines(text[:-1] if hold_cr else text)
        state.pending = lines.pop() + ("\r" if hold_cr else "")
        if len(state.pending) > self._limits.max_line_chars:
            lines.append(state.pending[: self._limits.max_line_chars])
            state.pending = state.pending[self._limits.max_line_chars :]
        self._emit(stream, lines)
        self._out.flush()

    def _full(self) -> bool:
        return self.shown_bytes >= self._limits.max_bytes or self.shown_lines >= self._limits.max_lines

    def _emit(self, stream: str, lines: list[str]) -> None:
        prefix = "[system] " if stream == "system" else ""
        width = self._limits.max_line_chars
        for line in lines:
            for start in range(0, max(len(line), 1), width):
                if self.shown_lines >= self._limits.max_lines:
                    self.dropped_bytes += len(line[start:].encode("utf-8", "replace"))
                    break
                self._out.write(prefix + neutralise_line(line[start : start + width]) + "\n")
                self.shown_lines += 1
