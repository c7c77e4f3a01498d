"""A job's log entries written to the user's terminal or pipes, as `run` and `jobs logs` show them.

stdout goes to stdout, stderr and the service's notes (stream "system") to stderr. The guest is hostile:
on a terminal its escape sequences could retitle the window, write the clipboard (OSC 52) or hide text,
so there control characters other than tab, newline, carriage return and backspace are shown as "?";
guest programs see no terminal, so they rarely emit colour anyway. Into a pipe the bytes go unchanged.
"""

from __future__ import annotations

import sys

_TERMINAL_SAFE = bytes(c if c >= 32 and c != 127 or c in b"\t\n\r\b" else ord("?") for c in range(256))


def show(stream_name: str, data: bytes) -> None:
    out = sys.stdout if stream_name == "stdout" else sys.stderr
    if stream_name == "system":
        data = b"[microvm-check] " + data + b"\n"
    if out.isatty():
        data = data.translate(_TERMINAL_SAFE)
    out.flush()
    out.buffer.write(data)
    out.buffer.flush()
