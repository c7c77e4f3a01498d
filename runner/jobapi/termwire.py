"""The terminal stream of `GET /v1/jobs/<id>/terminal` (docs/job-api.md), for the service and the CLI.

The request asks for an HTTP/1.1 Upgrade to UPGRADE; after the service's 101 both directions carry
frames: a kind byte, a big-endian u32 length, the payload (at most MAX_FRAME bytes). The client sends
INPUT (typed bytes), RESIZE ("ROWSxCOLS") and SIGNAL (a name: INT, QUIT, TERM, HUP, KILL, TSTP, CONT);
the service sends OUTPUT (the terminal's output, already filtered for a terminal) and, last, EXIT
(JSON: {"exit_code", "timed_out", "killed"} or {"error"}). Closing the connection detaches: the
session's program is ended, the job is not.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass

from runner.errors import ClientError

UPGRADE = "microvm-check-terminal"
INPUT, RESIZE, SIGNAL, OUTPUT, EXIT = b"i", b"r", b"s", b"o", b"x"
CLIENT_KINDS = frozenset({INPUT, RESIZE, SIGNAL})
SERVICE_KINDS = frozenset({OUTPUT, EXIT})
MAX_FRAME = 64 * 1024
_HEADER = struct.Struct(">cI")


class FrameError(ClientError):
    """The peer sent something that is not a frame of this terminal stream: the session ends (the service
    reads it from `jobs attach`, the client from the service; no HTTP status is left to answer with)."""


@dataclass(frozen=True)
class Frame:
    kind: bytes
    payload: bytes


def encode(kind: bytes, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise ValueError(f"a terminal frame of {len(payload)} bytes is over {MAX_FRAME}")
    return _HEADER.pack(kind, len(payload)) + payload


def encode_output(data: bytes) -> bytes:
    """OUTPUT frames for any amount of output."""
    return b"".join(encode(OUTPUT, data[i : i + MAX_FRAME]) for i in range(0, len(data), MAX_FRAME))


def encode_exit(outcome: dict[str, object]) -> bytes:
    return encode(EXIT, json.dumps(outcome).encode())


def resize_payload(rows: int, cols: int) -> bytes:
    return f"{rows}x{cols}".encode()


def parse_size(payload: bytes, largest: int) -> tuple[int, int]:
    """"ROWSxCOLS" as two integers in 1..largest, else FrameError."""
    rows, sep, cols = payload.partition(b"x")
    if not (sep and rows.isdigit() and cols.isdigit() and len(rows) <= 5 and len(cols) <= 5):
        raise FrameError(f"a resize is ROWSxCOLS, not {payload[:20]!r}")
    size = int(rows), int(cols)
    if not all(1 <= side <= largest for side in size):
        raise FrameError(f"a terminal of {size[0]}x{size[1]} is out of range (1..{largest} each)")
    return size


class FrameReader:
    """Frames from a blocking `recv(n)` (b"" at the end of the stream), each checked before it is read."""

    def __init__(self, recv: Callable[[int], bytes], kinds: frozenset[bytes], buffered: bytes = b"") -> None:
        self._recv, self._kinds, self._buf = recv, kinds, bytearray(buffered)

    def next(self) -> Frame | None:
        """The next frame, or None at a clean end of the stream (between frames)."""
        header = self._exactly(_HEADER.size)
        if header is None:
            return None
        kind, length = _HEADER.unpack(header)
        if kind not in self._kinds:
            raise FrameError(f"unknown terminal frame kind {kind!r}")
        if length > MAX_FRAME:
            raise FrameError(f"a terminal frame of {length} bytes is over {MAX_FRAME}")
        payload = self._exactly(length) if length else b""
        if payload is None:
            raise FrameError("the stream ended inside a frame")
        return Frame(kind, payload)

    def _exactly(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            chunk = self._recv(65536)
            if not chunk:
                if self._buf:
                    raise FrameError("the stream ended inside a frame")
                return None
            self._buf += chunk
        data, self._buf = bytes(self._buf[:n]), self._buf[n:]
        return data
