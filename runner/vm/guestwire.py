"""Wire format between the host and the guest agent, shared by both sides (stdlib only).

The single source for both: the host imports it as `runner.vm.guestwire`, and the rootfs builder
(vmimages/rootfs.py) installs this file as `guestwire.py` next to the guest agent, which imports it
by that name. So it must stay a standalone module: the standard library only, no project imports.

The channel is a virtio-serial port: a reliable byte stream with no message boundaries, and on
the host side the other end is a guest we do not trust. So every frame carries a fixed header
with a magic, a version and an explicit length that the reader checks *before* reading the
payload: a hostile or broken peer can make us fail, never make us allocate or wait without bound.

    header: magic b"MV" | version u8 | kind u8 | request id u32 | payload length u32   (big endian)

Kinds: MSG is a JSON object (requests, events, final replies); STDOUT/STDERR/DATA are raw bytes
belonging to a request; END closes a request's data stream. Every request gets exactly one final
MSG with an "ok" member; MSGs with an "ev" member before it are progress events.
"""

from __future__ import annotations

import json
import signal
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAGIC = b"MV"
VERSION = 1
HEADER = struct.Struct(">2sBBII")

MSG = 1
STDOUT = 2
STDERR = 3
DATA = 4
END = 5
KINDS = frozenset({MSG, STDOUT, STDERR, DATA, END})

MAX_MSG = 64 * 1024  # a JSON message: requests and replies are small
MAX_CHUNK = 256 * 1024  # a data chunk; writers split larger buffers
MAX_REQUEST_ID = 2**31

PORT_NAME = "org.microvm-check.agent.0"
CHECKOUT_DEVICE = "/dev/sr0"  # the template's only CD-ROM (runner/vm/qemu.py), where checkouts arrive

# The operations a request's "op" names: what the guest agent serves (vmimages/guest/agent.py `OPS`) and
# the host may send. A template records those its agent answered at bake time (its manifest's
# "agent_ops", from `ping`), and the host refuses a template whose agent lacks one of these
# (runner.vm.templates.stale_agent): a new operation is added here, and every template is rebuilt.
QUIESCE = "quiesce"
OPS = frozenset({"exec", "kill", "ping", "identity", "write_file", "read_file", "put_tar", "checkout", "get_tar",
                 "pty", "pty_ctl", QUIESCE})
# Why the guest refused to quiesce (its reply's "refused"): the VM runs on, not fit for a snapshot.
EXEC_RUNNING = "exec-running"  # a command is still running: it may be using the checkout
CHECKOUT_BUSY = "checkout-busy"  # a process left behind (a daemon) holds the checkout: it cannot be unmounted
SYNC_TIMED_OUT = "sync-timed-out"  # writing the page cache took longer than the request allowed
QUIESCE_REFUSALS = frozenset({EXEC_RUNNING, CHECKOUT_BUSY, SYNC_TIMED_OUT})


# A pty session (op "pty"): typed input the guest holds for a program that has not read it yet (more is
# dropped and counted), the largest side of a terminal, and the signals `pty_ctl` sends by name to the
# terminal's foreground process group.
PTY_INPUT_MAX = 1024 * 1024
PTY_MAX_SIDE = 1000
PTY_SIGNALS = {"INT": signal.SIGINT, "QUIT": signal.SIGQUIT, "TERM": signal.SIGTERM, "HUP": signal.SIGHUP,
               "KILL": signal.SIGKILL, "TSTP": signal.SIGTSTP, "CONT": signal.SIGCONT}


def unknown_op(op: object) -> str:
    """The error every guest agent so far answers for an op it does not know."""
    return f"unknown op {op!r}"


# A decoded MSG. Its values are whatever JSON held: the guest trusts its host's requests as they
# come, and the host narrows a guest's reply member by member (runner.vm.agent.GuestMessage).
JSONObject = dict[str, Any]


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame: the channel can no longer be trusted."""


@dataclass(frozen=True)
class Frame:
    kind: int
    request_id: int
    payload: bytes

    def json(self) -> JSONObject:
        return decode_msg(self.payload)


def encode(kind: int, request_id: int, payload: bytes = b"") -> bytes:
    limit = MAX_MSG if kind == MSG else MAX_CHUNK
    if len(payload) > limit:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {limit}")
    return HEADER.pack(MAGIC, VERSION, kind, request_id, len(payload)) + payload


def encode_msg(request_id: int, message: Mapping[str, object]) -> bytes:
    return encode(MSG, request_id, json.dumps(message, separators=(",", ":")).encode())


def decode_msg(payload: bytes) -> JSONObject:
    try:
        value = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"message is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"message is a JSON {type(value).__name__}, not an object")
    return value


def parse_header(header: bytes) -> tuple[int, int, int]:
    """Validate a header and return (kind, request id, payload length)."""
    magic, version, kind, request_id, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}: the peer is not speaking this protocol")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    if kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    limit = MAX_MSG if kind == MSG else MAX_CHUNK
    if length > limit:
        raise ProtocolError(f"frame of {length} bytes exceeds the {limit}-byte limit for kind {kind}")
    if request_id >= MAX_REQUEST_ID:
        raise ProtocolError(f"request id {request_id} out of range")
    return kind, request_id, length


class FrameReader:
    """Reads whole frames from a blocking `read(n)` callable; EOF inside a frame is an error."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read

    def _exactly(self, n: int, what: str) -> bytes | None:
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = self._read(n - got)
            if not chunk:
                if got == 0 and what == "header":
                    return None
                raise ProtocolError(f"channel closed in the middle of a frame {what} ({got}/{n} bytes)")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def next(self) -> Frame | None:
        """The next frame, or None on a clean end of stream between frames."""
        header = self._exactly(HEADER.size, "header")
        if header is None:
            return None
        kind, request_id, length = parse_header(header)
        payload = self._exactly(length, "payload") if length else b""
        assert payload is not None  # only a header read may meet a clean end of stream
        return Frame(kind, request_id, payload)
