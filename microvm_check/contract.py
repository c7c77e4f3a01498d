"""The sandbox API's wire contract (docs/sdk.md): what travels between the SDK and the service's
sandbox routes, declared once for both.

Here: the default socket, the headers, the routes' paths, the bounds a request is held to, and the
typed forms of what is sent (CreateRequest, ExecRequest, TerminalRequest) and answered (SandboxInfo,
CreateAnswer, ExecOutput and ExecEnd lines, FileEntry in a Listing, SnapshotAnswer, DestroyAnswer,
ErrorAnswer, TerminalEnd), each with `to_wire()` and `from_wire()`; and the framing of a terminal's
stream (after an HTTP/1.1 Upgrade), which the job API's `jobs attach` speaks too
(runner/jobapi/termwire.py). `from_wire()` takes what came over the wire as untrusted: it checks every field it reads
and raises WireError naming the first that is wrong; a field it does not know is left alone in an
answer (a newer service may add one), refused in a create's body.

It imports nothing but the standard library and microvm_check/entries.py (the record types, standard library
only too): the service imports the two (the modules of the SDK it may import, pyproject.toml's import-linter
contracts), and callers get them without the service's code.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from microvm_check.entries import AuditRecord

DEFAULT_SOCKET = "/run/microvm-check/api.sock"  # the job API's Unix socket (the service's `socket` setting)

# -- headers ----------------------------------------------------------------------------------------

# A sandbox's own credential, answered once by its create; every call on it but the create sends it.
SANDBOX_TOKEN_HEADER = "X-Microvm-Check-Sandbox-Token"
# A download's answer: how many members the service left out of the tar (each is a note in it instead).
SKIPPED_HEADER = "X-Microvm-Check-Skipped"

# -- routes -----------------------------------------------------------------------------------------

SANDBOXES = "/v1/sandboxes"  # POST: create
HIBERNATED = "hibernated"  # a SandboxInfo's state while its VM is parked (Route.HIBERNATE until Route.RESUME)
SANDBOX_ID = re.compile(r"j[0-9a-f]{16}")  # a sandbox is a job record: its id is a job id
TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")  # what a create answers (secrets.token_urlsafe); it goes into a header


class Route(enum.StrEnum):
    """One sandbox's calls: what follows /v1/sandboxes/<id> (the method is each call's own, docs/sdk.md)."""

    INFO = ""  # GET
    EXEC = "/exec"  # POST ExecRequest -> NDJSON ExecOutput lines, then ExecEnd (or ErrorAnswer)
    FILES = "/files"  # PUT ?path=P&mode=644 (the file's bytes) -> 204; GET ?path=P -> the bytes
    FILES_LIST = "/files/list"  # GET ?path=D -> Listing
    UPLOAD = "/upload"  # PUT ?dest=D (a tar) -> 204
    DOWNLOAD = "/download"  # GET ?glob=G&cwd=D -> a tar, SKIPPED_HEADER
    SNAPSHOT = "/snapshot"  # POST -> 201 SnapshotAnswer
    HIBERNATE = "/hibernate"  # POST -> 200 SandboxInfo (state HIBERNATED): its VM snapshotted and stopped
    RESUME = "/resume"  # POST -> 200 SandboxInfo: its VM restored from the hibernate, where it was
    DESTROY = "/destroy"  # POST -> 200 DestroyAnswer
    TERMINAL = "/terminal"  # GET ?TerminalRequest, Upgrade: TERMINAL_UPGRADE -> 101, then terminal frames


def sandbox_path(sandbox_id: str, route: Route = Route.INFO) -> str:
    """The path of one call on a sandbox; an id that is not one (it would reach another path) is a WireError."""
    if not SANDBOX_ID.fullmatch(sandbox_id):
        raise WireError(f"sandbox id: expected j and 16 hex digits, got {sandbox_id[:40]!r}")
    return f"{SANDBOXES}/{sandbox_id}{route.value}"


# -- bounds -----------------------------------------------------------------------------------------

MAX_NAME = 200  # a template's, a snapshot's (a create's `base`), a repository's, a VM's name
MAX_POLICY = 64 * 1024  # a create's own policy text (it only narrows the operator's)
MAX_PATH = 4096  # Linux's PATH_MAX: a guest path, a listed name
MAX_LISTED = 10_000  # entries a Listing holds
MAX_ARGV = 4096  # words of an exec's command
MAX_COMMAND = 256 * 1024  # characters of an exec's command, all words together
MAX_ENV = 64  # an exec's environment variables
MAX_ENV_ITEM = 32 * 1024  # characters of one name and its value
MAX_BLOCKED = 100  # blocked-egress entries an ExecEnd carries
MAX_STDIN = 512 * 1024  # bytes of an exec's `stdin` (base64 in its JSON body, which the service holds to 1 MiB)
STREAMS = ("stdout", "stderr")
FILE_TYPES = ("file", "dir", "link", "other")
WORKSPACE = "/workspace"  # an exec's default cwd, a listing's, an upload's and a download's


class WireError(ValueError):
    """What came over the wire does not have the contract's shape; the message names the field."""


# -- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateRequest:
    """POST /v1/sandboxes: a fresh sandbox from `template` (None: the service's default) or from a
    snapshot `base`, for `ttl_seconds`. `size` is refused by the service (sandboxes run at its default)."""

    template: str | None = None
    base: str | None = None
    policy: str | None = None  # the policy's YAML text
    ttl_seconds: float = 600.0
    size: str | None = None

    def to_wire(self) -> dict[str, object]:
        wire = {"template": self.template, "base": self.base, "policy": self.policy,
                "ttl_seconds": self.ttl_seconds, "size": self.size}
        return {key: value for key, value in wire.items() if value is not None}

    @classmethod
    def from_wire(cls, data: object) -> CreateRequest:
        data = _object(data, "the body: {template, base, policy, ttl_seconds}")
        unknown = set(data) - {"template", "base", "policy", "ttl_seconds", "size"}
        if unknown:
            raise WireError(f"unknown field(s) {', '.join(sorted(map(str, unknown)))[:200]}")
        return cls(template=_text(data, "template", MAX_NAME, optional=True),
                   base=_text(data, "base", MAX_NAME, optional=True, meaning="the name a snapshot() answered"),
                   policy=_text(data, "policy", MAX_POLICY, optional=True, meaning="the policy's YAML text"),
                   ttl_seconds=_number(data, "ttl_seconds", required=False, default=600.0, above=0),
                   size=_text(data, "size", MAX_NAME, optional=True))


@dataclass(frozen=True)
class ExecRequest:
    """POST .../exec: a shell string (run by sh -c) or an argv list; `timeout_seconds` None is the
    service's most (sandboxes.exec_timeout_seconds). `stdin` is the command's whole input (at most
    MAX_STDIN bytes, in the guest before it starts; None: it reads an empty one)."""

    command: str | tuple[str, ...]
    timeout_seconds: float | None = None
    cwd: str = WORKSPACE
    env: Mapping[str, str] = field(default_factory=dict)
    stdin: bytes | None = None

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {"command": self.command if isinstance(self.command, str) else list(self.command),
                                   "cwd": self.cwd, "env": dict(self.env)}
        if self.timeout_seconds is not None:
            wire["timeout_seconds"] = self.timeout_seconds
        if self.stdin is not None:
            wire["stdin"] = base64.b64encode(self.stdin).decode()
        return wire

    @classmethod
    def from_wire(cls, data: object) -> ExecRequest:
        data = _object(data, "the body: {command, timeout_seconds, cwd, env, stdin}")
        timeout = _number(data, "timeout_seconds", required=False, above=0)
        return cls(_command(data.get("command")), timeout, _text(data, "cwd", MAX_PATH, default=WORKSPACE),
                   _env(data.get("env")), _stdin(data))


# -- answers ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SandboxInfo:
    """GET /v1/sandboxes/<id>, and a create's answer: what the sandbox is. `template` is the template
    it comes from (a fork's is its source's), `base` the snapshot it was restored from; `ttl_seconds`
    its whole life, `expires_in` what is left of it when answered."""

    id: str
    template: str
    base: str | None
    state: str  # its job record's (running while it is alive), or HIBERNATED while it is parked
    repository: str  # whose egress policy it runs under (sandboxes.repository)
    vm_id: str | None
    ttl_seconds: float
    expires_in: float
    accel: str | None  # kvm or tcg
    ready_ms: float | None  # how long its VM took to be ready

    def to_wire(self) -> dict[str, object]:
        return {"id": self.id, "template": self.template, "base": self.base, "state": self.state,
                "repository": self.repository, "vm_id": self.vm_id, "ttl_seconds": self.ttl_seconds,
                "expires_in": self.expires_in, "accel": self.accel, "ready_ms": self.ready_ms}

    @classmethod
    def from_wire(cls, data: object) -> SandboxInfo:
        data = _object(data, "sandbox info")
        return cls(id=_sandbox_id(data), template=_text(data, "template", MAX_NAME),
                   base=_text(data, "base", MAX_NAME, optional=True), state=_text(data, "state", 32),
                   repository=_text(data, "repository", MAX_NAME), vm_id=_text(data, "vm_id", MAX_NAME, optional=True),
                   ttl_seconds=_number(data, "ttl_seconds", above=0), expires_in=_number(data, "expires_in", least=0),
                   accel=_text(data, "accel", 16, optional=True),
                   ready_ms=_number(data, "ready_ms", required=False, least=0))


@dataclass(frozen=True)
class CreateAnswer:
    """201 to POST /v1/sandboxes: the sandbox's info and its token (answered this once)."""

    info: SandboxInfo
    token: str = field(repr=False)

    def to_wire(self) -> dict[str, object]:
        return {**self.info.to_wire(), "token": self.token}

    @classmethod
    def from_wire(cls, data: object) -> CreateAnswer:
        data = _object(data, "create answer")
        token = data.get("token")
        if not isinstance(token, str) or not TOKEN.fullmatch(token):
            raise WireError("token: expected 16 to 128 characters of A-Z, a-z, 0-9, _ and -")
        return cls(SandboxInfo.from_wire(data), token)


@dataclass(frozen=True)
class ExecOutput:
    """An exec's output line: a chunk of one stream, as it came."""

    stream: str  # stdout or stderr
    data: bytes

    def to_wire(self) -> dict[str, object]:
        return {"stream": self.stream, "data": base64.b64encode(self.data).decode()}

    @classmethod
    def from_wire(cls, data: object) -> ExecOutput:
        data = _object(data, "exec output")
        stream = data.get("stream")
        if stream not in STREAMS:
            raise WireError(f"stream: expected stdout or stderr, got {str(stream)[:20]!r}")
        text = _text(data, "data", None)
        try:
            return cls(str(stream), base64.b64decode(text, validate=True))
        except binascii.Error as exc:
            raise WireError("data: expected base64") from exc


@dataclass(frozen=True)
class ExecEnd:
    """An exec's last line: how its command ended. `truncated`: the output budget was reached and the
    command killed; `blocked_egress`: what the sandbox's policy refused so far (at most MAX_BLOCKED; an
    entry that breaks `AuditRecord.from_wire`'s rules is left out)."""

    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    duration_ms: float = 0.0
    blocked_egress: tuple[AuditRecord, ...] = ()

    def to_wire(self) -> dict[str, object]:
        return {"exit_code": self.exit_code, "timed_out": self.timed_out, "truncated": self.truncated,
                "duration_ms": self.duration_ms, "blocked_egress": [b.to_wire() for b in self.blocked_egress]}

    @classmethod
    def from_wire(cls, data: object) -> ExecEnd:
        data = _object(data, "exec result")
        exit_code = data.get("exit_code")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int):
            raise WireError(f"exit_code: expected an integer, got {type(exit_code).__name__}")
        blocked = data.get("blocked_egress") or []
        if not isinstance(blocked, list) or len(blocked) > MAX_BLOCKED or not all(isinstance(b, dict) for b in blocked):
            raise WireError(f"blocked_egress: expected a list of at most {MAX_BLOCKED} JSON objects")
        return cls(exit_code, _flag(data, "timed_out"), _flag(data, "truncated"),
                   _number(data, "duration_ms", required=False, default=0.0, least=0),
                   tuple(b for b in map(AuditRecord.from_wire, blocked) if b is not None))


@dataclass(frozen=True)
class ErrorAnswer:
    """A refusal's body (with its 4xx/5xx status), or the line that ends an exec's stream which had
    begun when something failed."""

    error: str

    def to_wire(self) -> dict[str, object]:
        return {"error": self.error}

    @classmethod
    def from_wire(cls, data: object) -> ErrorAnswer:
        return cls(_text(_object(data, "error answer"), "error", None))


def exec_line(data: object) -> ExecOutput | ExecEnd | ErrorAnswer:
    """One line of an exec's answer, by what it carries: output, the error that ended it, or its result."""
    data = _object(data, "exec line")
    if "stream" in data:
        return ExecOutput.from_wire(data)
    if "error" in data:
        return ErrorAnswer.from_wire(data)
    return ExecEnd.from_wire(data)


@dataclass(frozen=True)
class FileEntry:
    """One entry of a listed directory."""

    name: str  # relative to the listed directory
    type: str  # file, dir, link, other
    size: int

    def to_wire(self) -> dict[str, object]:
        return {"name": self.name, "type": self.type, "size": self.size}

    @classmethod
    def from_wire(cls, data: object) -> FileEntry:
        data = _object(data, "file entry")
        kind, size = data.get("type"), data.get("size")
        if kind not in FILE_TYPES:
            raise WireError(f"type: expected one of {', '.join(FILE_TYPES)}, got {str(kind)[:20]!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise WireError("size: expected a byte count")
        return cls(_text(data, "name", MAX_PATH), str(kind), size)


@dataclass(frozen=True)
class Listing:
    """GET .../files/list: a directory's entries (at most MAX_LISTED; `truncated` when there were more
    than the service reads)."""

    path: str
    entries: tuple[FileEntry, ...]
    truncated: bool = False

    def to_wire(self) -> dict[str, object]:
        return {"path": self.path, "entries": [e.to_wire() for e in self.entries], "truncated": self.truncated}

    @classmethod
    def from_wire(cls, data: object) -> Listing:
        data = _object(data, "listing")
        entries = data.get("entries")
        if not isinstance(entries, list) or len(entries) > MAX_LISTED:
            raise WireError(f"entries: expected a list of at most {MAX_LISTED}")
        return cls(_text(data, "path", MAX_PATH), tuple(FileEntry.from_wire(e) for e in entries),
                   _flag(data, "truncated"))


@dataclass(frozen=True)
class SnapshotAnswer:
    """201 to POST .../snapshot: the snapshot's name, a create's `base`."""

    base: str

    def to_wire(self) -> dict[str, object]:
        return {"base": self.base}

    @classmethod
    def from_wire(cls, data: object) -> SnapshotAnswer:
        return cls(_text(_object(data, "snapshot answer"), "base", MAX_NAME))


@dataclass(frozen=True)
class DestroyAnswer:
    """200 to POST .../destroy: the sandbox is gone."""

    id: str
    destroyed: bool = True

    def to_wire(self) -> dict[str, object]:
        return {"destroyed": self.destroyed, "id": self.id}

    @classmethod
    def from_wire(cls, data: object) -> DestroyAnswer:
        data = _object(data, "destroy answer")
        return cls(_sandbox_id(data), _flag(data, "destroyed"))


# -- a terminal's stream ------------------------------------------------------------------------------
#
# GET /v1/sandboxes/<id>/terminal (and the job API's GET /v1/jobs/<id>/terminal, `jobs attach`) asks for
# an HTTP/1.1 Upgrade to TERMINAL_UPGRADE; after the service's 101 both directions carry frames: a kind
# byte, a big-endian u32 length, the payload (at most MAX_FRAME bytes). The client sends INPUT (typed
# bytes), RESIZE ("ROWSxCOLS") and SIGNAL (a name of TERMINAL_SIGNALS); the service sends OUTPUT (the
# terminal's output) and, last, EXIT (a TerminalEnd). Closing the connection detaches: the session's
# program is ended, the sandbox (or the job) is not.

TERMINAL_UPGRADE = "microvm-check-terminal"
INPUT, RESIZE, SIGNAL, OUTPUT, EXIT = b"i", b"r", b"s", b"o", b"x"
CLIENT_KINDS = frozenset({INPUT, RESIZE, SIGNAL})
SERVICE_KINDS = frozenset({OUTPUT, EXIT})
MAX_FRAME = 64 * 1024
MAX_SIDE = 1000  # a terminal's rows or columns (the guest agent's own bound)
TERMINAL_SIGNALS = ("INT", "QUIT", "TERM", "HUP", "KILL", "TSTP", "CONT")  # sent to the foreground process group
_FRAME_HEADER = struct.Struct(">cI")


class FrameError(WireError):
    """The peer sent something that is not a frame of a terminal's stream: the session ends (no HTTP
    status is left to answer with)."""


@dataclass(frozen=True)
class Frame:
    kind: bytes
    payload: bytes


def encode_frame(kind: bytes, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise ValueError(f"a terminal frame of {len(payload)} bytes is over {MAX_FRAME}")
    return _FRAME_HEADER.pack(kind, len(payload)) + payload


def encode_frames(kind: bytes, data: bytes) -> bytes:
    """Frames of `kind` (OUTPUT, INPUT) for any amount of data (none for b"")."""
    return b"".join(encode_frame(kind, data[i : i + MAX_FRAME]) for i in range(0, len(data), MAX_FRAME))


def resize_payload(rows: int, cols: int) -> bytes:
    return f"{rows}x{cols}".encode()


def parse_size(payload: bytes, largest: int = MAX_SIDE) -> tuple[int, int]:
    """"ROWSxCOLS" as two integers in 1..largest, else FrameError."""
    rows, sep, cols = payload.partition(b"x")
    if not (sep and rows.isdigit() and cols.isdigit() and len(rows) <= 5 and len(cols) <= 5):
        raise FrameError(f"a resize is ROWSxCOLS, not {payload[:20]!r}")
    size = int(rows), int(cols)
    if not all(1 <= side <= largest for side in size):
        raise FrameError(f"a terminal of {size[0]}x{size[1]} is out of range (1..{largest} each)")
    return size


class FrameDecoder:
    """Frames out of bytes fed as they came (no I/O: the blocking and the asyncio readers both use it).
    A frame's kind and length are checked from its header, before its payload is waited for, so what is
    held is at most one frame and the last chunk fed."""

    def __init__(self, kinds: frozenset[bytes], buffered: bytes = b"") -> None:
        self._kinds, self._buf = kinds, bytearray(buffered)

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def partial(self) -> bool:
        """Bytes of a frame not complete yet are held (the stream ending now ends inside a frame)."""
        return bool(self._buf)

    def next(self) -> Frame | None:
        """The next whole frame fed, or None until more is fed; FrameError for one off the stream's rules."""
        if len(self._buf) < _FRAME_HEADER.size:
            return None
        kind, length = _FRAME_HEADER.unpack_from(self._buf)
        if kind not in self._kinds:
            raise FrameError(f"unknown terminal frame kind {kind!r}")
        if length > MAX_FRAME:
            raise FrameError(f"a terminal frame of {length} bytes is over {MAX_FRAME}")
        end = _FRAME_HEADER.size + length
        if len(self._buf) < end:
            return None
        payload = bytes(self._buf[_FRAME_HEADER.size : end])
        del self._buf[:end]
        return Frame(kind, payload)


class FrameReader:
    """Frames from a blocking `recv(n)` (b"" at the end of the stream), each checked before it is read."""

    def __init__(self, recv: Callable[[int], bytes], kinds: frozenset[bytes], buffered: bytes = b"") -> None:
        self._recv, self._decoder = recv, FrameDecoder(kinds, buffered)

    def next(self) -> Frame | None:
        """The next frame, or None at a clean end of the stream (between frames)."""
        while (frame := self._decoder.next()) is None:
            chunk = self._recv(65536)
            if not chunk:
                if self._decoder.partial:
                    raise FrameError("the stream ended inside a frame")
                return None
            self._decoder.feed(chunk)
        return frame


@dataclass(frozen=True)
class TerminalRequest:
    """GET .../terminal's query: the program (`argv`; empty: the sandbox's login shell), the terminal's
    size, its working directory and environment (beside TERM)."""

    argv: tuple[str, ...] = ()
    rows: int = 24
    cols: int = 80
    cwd: str = WORKSPACE
    env: Mapping[str, str] = field(default_factory=dict)

    def to_query(self) -> list[tuple[str, str]]:
        return [("size", f"{self.rows}x{self.cols}"), ("cwd", self.cwd), *(("argv", a) for a in self.argv),
                *(("env", f"{k}={v}") for k, v in self.env.items())]

    @classmethod
    def from_query(cls, query: Mapping[str, list[str]]) -> TerminalRequest:
        unknown = set(query) - {"size", "cwd", "argv", "env"}
        if unknown:
            raise WireError(f"unknown parameter(s) {', '.join(sorted(unknown))[:200]}")
        argv = list(query.get("argv", []))
        if argv:
            _command(argv)
        if any("\0" in a for a in argv):
            raise WireError("argv: no NUL characters")
        pairs = [item.partition("=") for item in query.get("env", [])]
        if any(not sep or not name for name, sep, _ in pairs):
            raise WireError("env: expected NAME=VALUE")
        env = _env({name: value for name, _, value in pairs})
        if len(env) != len(pairs) or any("\0" in k or "\0" in v for k, v in env.items()):
            raise WireError("env: each name once, no NUL characters")
        rows, cols = parse_size(_last(query, "size", "24x80").encode())
        cwd = _last(query, "cwd", WORKSPACE)
        if not cwd.startswith("/") or "\0" in cwd or len(cwd) > MAX_PATH:
            raise WireError(f"cwd: expected an absolute path of at most {MAX_PATH} characters")
        return cls(tuple(argv), rows, cols, cwd, env)


@dataclass(frozen=True)
class TerminalEnd:
    """A terminal's EXIT frame: how its program ended (`exit_code`; `timed_out` past the service's deadline;
    `killed`: ended from the host, by a detach), or the `error` that ended the session instead."""

    exit_code: int | None = None
    timed_out: bool = False
    killed: bool = False
    error: str | None = None

    def to_wire(self) -> dict[str, object]:
        if self.error is not None:
            return {"error": self.error}
        return {"exit_code": self.exit_code, "timed_out": self.timed_out, "killed": self.killed}

    @classmethod
    def from_wire(cls, data: object) -> TerminalEnd:
        data = _object(data, "terminal end")
        if "error" in data:
            return cls(error=_text(data, "error", MAX_FRAME))
        exit_code = data.get("exit_code")
        if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)):
            raise WireError(f"exit_code: expected an integer or null, got {type(exit_code).__name__}")
        return cls(exit_code, _flag(data, "timed_out"), _flag(data, "killed"))

    @classmethod
    def of_frame(cls, payload: bytes) -> TerminalEnd:
        """An EXIT frame's payload (JSON), checked."""
        try:
            return cls.from_wire(json.loads(payload))
        except ValueError as exc:  # not JSON (WireError is one too)
            raise FrameError(f"the terminal's EXIT frame is not a TerminalEnd: {exc}") from None


# -- field readers ----------------------------------------------------------------------------------


def _object(data: object, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise WireError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _text(data: Mapping[str, Any], key: str, most: int | None, *, optional: bool = False,
          default: str | None = None, meaning: str = "a string") -> Any:
    """A string field (None when `optional` and absent or null; `default` when absent), at most `most` long."""
    value = data.get(key, default)
    if value is None and optional:
        return None
    if not isinstance(value, str) or (most is not None and len(value) > most):
        bound = f" of at most {most} characters" if most is not None else ""
        raise WireError(f"{key}: expected {meaning}{bound}")
    return value


def _number(data: Mapping[str, Any], key: str, *, required: bool = True, default: float | None = None,
            above: float | None = None, least: float | None = None) -> Any:
    """A finite number field (a bool is none), `default` when it is not `required` and absent or null."""
    value = data.get(key)
    if value is None and not required:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (above is not None and value <= above) or (least is not None and value < least):
        floor = f" above {above:g}" if above is not None else f" of at least {least:g}" if least is not None else ""
        raise WireError(f"{key}: expected a number{floor}")
    return float(value)


def _flag(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise WireError(f"{key}: expected true or false")
    return value


def _sandbox_id(data: Mapping[str, Any]) -> str:
    value = data.get("id")
    if not isinstance(value, str) or not SANDBOX_ID.fullmatch(value):
        raise WireError("id: expected a sandbox id (j and 16 hex digits)")
    return value


def _command(command: object) -> str | tuple[str, ...]:
    words = [command] if isinstance(command, str) else command
    if not isinstance(words, list) or not words or len(words) > MAX_ARGV \
            or not all(isinstance(w, str) for w in words) or command == "":
        raise WireError("command: expected a shell string or a non-empty list of strings")
    if sum(len(w) for w in words) > MAX_COMMAND:
        raise WireError(f"command: at most {MAX_COMMAND // 1024} KiB")
    return command if isinstance(command, str) else tuple(words)


def _env(env: object) -> dict[str, str]:
    env = env or {}
    if not isinstance(env, dict) or len(env) > MAX_ENV or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= MAX_ENV_ITEM for k, v in env.items()):
        raise WireError(f"env: expected at most {MAX_ENV} string names and values")
    return dict(env)


def _stdin(data: Mapping[str, Any]) -> bytes | None:
    text = _text(data, "stdin", (MAX_STDIN + 2) // 3 * 4, optional=True, meaning="base64 bytes")
    if text is None:
        return None
    try:
        stdin = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise WireError("stdin: expected base64") from exc
    if len(stdin) > MAX_STDIN:  # the text's bound lets its last group of four carry a byte more
        raise WireError(f"stdin: expected base64 bytes of at most {MAX_STDIN} bytes, got {len(stdin)}")
    return stdin


def _last(query: Mapping[str, list[str]], name: str, default: str) -> str:
    values = query.get(name)
    return values[-1] if values else default
