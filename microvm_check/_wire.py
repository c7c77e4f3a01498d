"""What the sync and async clients share: where the service is, how each call is asked and how each
answer is read (both in the shapes of microvm_check/contract.py, which the service builds them from).
Only the sending differs (httpx.Client or httpx.AsyncClient, over the same kind of transport), as in
httpx's own client/transport split."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from microvm_check.contract import (
    DEFAULT_SOCKET,
    EXIT,
    INPUT,
    MAX_SIDE,
    MAX_STDIN,
    RESIZE,
    SANDBOXES,
    SERVICE_KINDS,
    SIGNAL,
    TERMINAL_SIGNALS,
    TERMINAL_UPGRADE,
    CreateRequest,
    ErrorAnswer,
    ExecEnd,
    ExecOutput,
    ExecRequest,
    FrameDecoder,
    Route,
    TerminalEnd,
    TerminalRequest,
    WireError,
    encode_frame,
    encode_frames,
    exec_line,
    resize_payload,
    sandbox_path,
)
from microvm_check.entries import AuditRecord

Answer = TypeVar("Answer")
MAX_ANSWER = 16 * 1024 * 1024  # a JSON answer
MAX_LINE = 4 * 1024 * 1024  # one exec output line (base64)
DEFAULT_DOWNLOAD = 256 * 1024 * 1024
CONNECT_SECONDS = 30.0
MARGIN_SECONDS = 30.0  # past an exec's own deadline before the client gives up on the service
TERMINAL_WRITE_SECONDS = 30.0  # a terminal's input, resize or signal the service does not take for this long
TERMINAL_READ = 64 * 1024  # bytes asked of the connection at once


class SandboxError(Exception):
    """The service refused a call or the sandbox is gone (`status` is the HTTP status; None: not reached).
    A command's non-zero exit is not one: it is an ExecResult."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool
    truncated: bool  # the service's output budget for one exec was reached: the command was killed
    blocked_egress: list[AuditRecord] = field(default_factory=list)  # what the policy refused so far


@dataclass(frozen=True)
class Service:
    """Where the service is: its Unix socket (the peer's uid is who you are), or http://HOST:PORT with the
    operator's bearer token. Environment: MICROVM_CHECK_SOCKET, or MICROVM_CHECK_URL + MICROVM_CHECK_TOKEN."""

    socket: str | None = None
    url: str | None = None
    token: str | None = None

    @classmethod
    def from_env(cls) -> Service:
        url = os.environ.get("MICROVM_CHECK_URL")
        if url:
            return cls(url=url, token=os.environ.get("MICROVM_CHECK_TOKEN"))
        return cls(socket=os.environ.get("MICROVM_CHECK_SOCKET", DEFAULT_SOCKET))

    def base_url(self) -> str:
        return self.url.rstrip("/") if self.url else "http://localhost"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.url and self.token else {}

    def transport_args(self) -> dict[str, Any]:
        # one connection per call, none kept: a client that is never closed leaves no socket open
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
        return {"uds": self.socket or DEFAULT_SOCKET, "verify": False, "limits": limits} if not self.url \
            else {"limits": limits}


@dataclass(frozen=True)
class Call:
    """One request: what the sync and async senders both send."""

    method: str
    path: str
    params: tuple[tuple[str, str], ...] = ()
    json: Any = None
    content: bytes | None = None
    read_seconds: float = 120.0
    headers: tuple[tuple[str, str], ...] = ()


def create_call(template: str | None, base: str | None, policy: str | None, ttl_seconds: float,
                size: str | None = None) -> Call:
    # a VM restore under software emulation, behind others, takes a while
    return Call("POST", SANDBOXES, json=CreateRequest(template, base, policy, ttl_seconds, size).to_wire(),
                read_seconds=600.0)


def info_call(sandbox_id: str) -> Call:
    """The one call whose id the caller gives (Sandbox.connect): any other's came in a checked answer."""
    try:
        return Call("GET", sandbox_path(sandbox_id))
    except WireError as exc:
        raise SandboxError(str(exc)) from exc


def exec_call(sandbox_id: str, command: str | list[str], timeout: float | None, cwd: str,
              env: dict[str, str] | None, stdin: bytes | str | None = None) -> Call:
    data = stdin.encode() if isinstance(stdin, str) else stdin
    if data is not None and len(data) > MAX_STDIN:
        raise SandboxError(f"exec: stdin is {len(data)} bytes, more than the {MAX_STDIN} an exec takes "
                           "(write a file with files.write and redirect from it)")
    request = ExecRequest(command if isinstance(command, str) else tuple(command), timeout, cwd, dict(env or {}),
                          data)
    # the service ends the call at its deadline; only the service's own silence beyond it is an error
    return Call("POST", sandbox_path(sandbox_id, Route.EXEC), json=request.to_wire(),
                read_seconds=(request.timeout_seconds or 3600.0) + MARGIN_SECONDS)


def write_call(sandbox_id: str, path: str, data: bytes, mode: int) -> Call:
    return Call("PUT", sandbox_path(sandbox_id, Route.FILES), (("path", path), ("mode", f"{mode:o}")), content=data)


def read_call(sandbox_id: str, path: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, Route.FILES), (("path", path),))


def list_call(sandbox_id: str, path: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, Route.FILES_LIST), (("path", path),))


def upload_call(sandbox_id: str, source: str | os.PathLike[str] | bytes, dest: str) -> Call:
    return Call("PUT", sandbox_path(sandbox_id, Route.UPLOAD), (("dest", dest),), content=tar_of(source),
                read_seconds=600.0)


def download_call(sandbox_id: str, globs: list[str], cwd: str) -> Call:
    return Call("GET", sandbox_path(sandbox_id, Route.DOWNLOAD), (*(("glob", g) for g in globs), ("cwd", cwd)),
                read_seconds=600.0)


def snapshot_call(sandbox_id: str) -> Call:
    return Call("POST", sandbox_path(sandbox_id, Route.SNAPSHOT), json={}, read_seconds=900.0)


def hibernate_call(sandbox_id: str) -> Call:
    # its VM's memory and disk written out (a migration, slow under software emulation), then it is stopped
    return Call("POST", sandbox_path(sandbox_id, Route.HIBERNATE), json={}, read_seconds=900.0)


def resume_call(sandbox_id: str) -> Call:
    """Like `info_call`, a call whose id the caller gives (Sandbox.resume)."""
    try:
        return Call("POST", sandbox_path(sandbox_id, Route.RESUME), json={}, read_seconds=600.0)
    except WireError as exc:
        raise SandboxError(str(exc)) from exc


def destroy_call(sandbox_id: str) -> Call:
    return Call("POST", sandbox_path(sandbox_id, Route.DESTROY), json={})


def terminal_call(sandbox_id: str, command: str | list[str] | None, rows: int, cols: int, cwd: str,
                  env: dict[str, str] | None) -> Call:
    """GET .../terminal asking for the Upgrade; a shell string runs under /bin/sh -c, None is the sandbox's shell."""
    argv = ("/bin/sh", "-c", command) if isinstance(command, str) else tuple(command or ())
    _check_size(rows, cols)
    request = TerminalRequest(argv, rows, cols, cwd, dict(env or {}))
    return Call("GET", sandbox_path(sandbox_id, Route.TERMINAL), tuple(request.to_query()), read_seconds=120.0,
                headers=(("Upgrade", TERMINAL_UPGRADE), ("Connection", "Upgrade")))


def _check_size(rows: int, cols: int) -> None:
    if not all(isinstance(side, int) and not isinstance(side, bool) and 1 <= side <= MAX_SIDE for side in (rows, cols)):
        raise SandboxError(f"terminal: rows and cols are integers from 1 to {MAX_SIDE}")


def input_frames(data: bytes | str) -> bytes:
    return encode_frames(INPUT, data.encode() if isinstance(data, str) else bytes(data))


def resize_frame(rows: int, cols: int) -> bytes:
    _check_size(rows, cols)
    return encode_frame(RESIZE, resize_payload(rows, cols))


def signal_frame(name: str) -> bytes:
    if name not in TERMINAL_SIGNALS:
        raise SandboxError(f"terminal: no signal {str(name)[:20]!r}; one of {', '.join(TERMINAL_SIGNALS)}")
    return encode_frame(SIGNAL, name.encode())


def stream_error(what: str, exc: Exception) -> Exception:
    """An error of an upgraded connection (httpx hands it over as its transport's network stream, whose
    errors httpx does not re-export): a timeout is TimeoutError, anything else the service breaking off."""
    if isinstance(exc, TimeoutError) or type(exc).__name__.endswith("Timeout"):
        return TimeoutError(f"{what}: nothing within the timeout")
    return SandboxError(f"{what}: the service broke off: {exc}")


class TerminalReader:
    """A terminal's frames from the service (the contract's framing), as the bytes came: its output chunks,
    then its end. Whatever is off the stream's rules (a kind, a size, an EXIT that is not a TerminalEnd, a
    frame after it, the stream ending before it) is a SandboxError; at most one frame is held."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.end: TerminalEnd | None = None
        self._decoder = FrameDecoder(SERVICE_KINDS)

    def feed(self, data: bytes) -> list[bytes]:
        """The output chunks `data` completed (b"": the stream ended)."""
        if not data:
            if self.end is None:
                inside = " inside a frame" if self._decoder.partial else ""
                raise SandboxError(f"{self.what}: the service closed the terminal{inside} before its end")
            return []
        self._decoder.feed(data)
        chunks = []
        try:
            while (frame := self._decoder.next()) is not None:
                if self.end is not None:
                    raise WireError("a frame after the EXIT frame")
                if frame.kind == EXIT:
                    self.end = TerminalEnd.of_frame(frame.payload)
                elif frame.payload:
                    chunks.append(frame.payload)
        except WireError as exc:
            raise SandboxError(f"{self.what}: the service's stream is not a terminal's: {exc}") from exc
        return chunks


def timeout_of(call: Call) -> httpx.Timeout:
    return httpx.Timeout(connect=CONNECT_SECONDS, read=call.read_seconds, write=120.0, pool=120.0)


def error_of(call: Call, status: int, body: bytes) -> SandboxError:
    """A refusal as SandboxError: its ErrorAnswer's reason, or the start of a body that is none (a proxy's)."""
    try:
        message = ErrorAnswer.from_wire(json.loads(body)).error[:2000]
    except ValueError:  # not JSON, or not an ErrorAnswer (WireError)
        message = body[:500].decode("utf-8", "replace")
    return SandboxError(f"{call.method} {call.path}: {status}: {message}", status)


def answer_of(call: Call, body: bytes, parse: Callable[[object], Answer]) -> Answer:
    """A JSON answer read as the contract's record by `parse` (its from_wire); one that is not is a SandboxError."""
    if len(body) > MAX_ANSWER:
        raise SandboxError(f"{call.method} {call.path}: the answer is larger than {MAX_ANSWER} bytes")
    try:
        return parse(json.loads(body))
    except ValueError as exc:  # not JSON, or not the record (WireError)
        raise SandboxError(f"{call.method} {call.path}: the service's answer is not the sandbox API's: {exc}") from exc


class ExecReader:
    """An exec's NDJSON answer, line by line (the contract's exec_line), into output callbacks and the
    final result."""

    def __init__(self, on_output: Any, capture_bytes: int) -> None:
        self.on_output, self.capture = on_output, capture_bytes
        self.parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.sizes = {"stdout": 0, "stderr": 0}
        self.end: ExecEnd | None = None

    def line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        if len(raw) > MAX_LINE:
            raise SandboxError("the service sent an exec line larger than the client's limit")
        try:
            entry = exec_line(json.loads(raw))
        except ValueError as exc:  # not JSON, or not a line of the contract (WireError)
            raise SandboxError(f"exec: the service sent a line that is not the sandbox API's: {exc}") from exc
        if isinstance(entry, ExecOutput):
            self._output(entry)
        elif isinstance(entry, ErrorAnswer):
            raise SandboxError(f"exec: {entry.error}")
        else:
            self.end = entry

    def _output(self, output: ExecOutput) -> None:
        if self.on_output is not None:
            self.on_output(output.stream, output.data)
        keep = output.data[: max(0, self.capture - self.sizes[output.stream])]
        self.parts[output.stream].append(keep)
        self.sizes[output.stream] += len(keep)

    def result(self) -> ExecResult:
        if self.end is None:
            raise SandboxError("exec: the service's answer ended before the command's result")
        end = self.end
        return ExecResult(end.exit_code, b"".join(self.parts["stdout"]), b"".join(self.parts["stderr"]),
                          end.duration_ms, end.timed_out, end.truncated, list(end.blocked_egress))


def tar_of(source: str | os.PathLike[str] | bytes) -> bytes:
    """A tar to upload: the bytes of one already, a .tar file, or a directory's contents packed here."""
    if isinstance(source, bytes):
        return source
    path = Path(source)
    if path.is_file():
        return path.read_bytes()
    if not path.is_dir():
        raise SandboxError(f"upload: {path} is neither a directory nor a tar file")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(path.iterdir()):
            tar.add(entry, arcname=entry.name)
    return buffer.getvalue()
