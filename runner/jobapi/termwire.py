"""The terminal stream of `GET /v1/jobs/<id>/terminal` (docs/job-api.md), for the service and the CLI.

Its framing is the sandbox API's terminal stream, declared once in microvm_check/contract.py (the one
module of the SDK the runner may import): the request asks for an HTTP/1.1 Upgrade to UPGRADE; after
the service's 101 both directions carry frames: a kind byte, a big-endian u32 length, the payload (at
most MAX_FRAME bytes). The client sends INPUT (typed bytes), RESIZE ("ROWSxCOLS") and SIGNAL (a name:
INT, QUIT, TERM, HUP, KILL, TSTP, CONT); the service sends OUTPUT (for `jobs attach`, the terminal's
output already filtered for a terminal) and, last, EXIT (JSON: {"exit_code", "timed_out", "killed"} or
{"error"}). Closing the connection detaches: the session's program is ended, the job is not.
"""

from __future__ import annotations

import json

from microvm_check.contract import (
    CLIENT_KINDS,
    EXIT,
    INPUT,
    MAX_FRAME,
    OUTPUT,
    RESIZE,
    SERVICE_KINDS,
    SIGNAL,
    Frame,
    FrameError,
    FrameReader,
    encode_frames,
    parse_size,
    resize_payload,
)
from microvm_check.contract import TERMINAL_UPGRADE as UPGRADE
from microvm_check.contract import encode_frame as encode

__all__ = ["CLIENT_KINDS", "EXIT", "INPUT", "MAX_FRAME", "OUTPUT", "RESIZE", "SERVICE_KINDS", "SIGNAL", "UPGRADE",
           "Frame", "FrameError", "FrameReader", "encode", "encode_exit", "encode_output", "parse_size",
           "resize_payload"]


def encode_output(data: bytes) -> bytes:
    """OUTPUT frames for any amount of output."""
    return encode_frames(OUTPUT, data)


def encode_exit(outcome: dict[str, object]) -> bytes:
    return encode(EXIT, json.dumps(outcome).encode())
