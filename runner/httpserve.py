"""Bounded HTTP/1.1 serving for the service's two listeners: the job API and the GitHub webhook.

Why not `socketserver`'s thread per connection: there, a silent or slow client holds a thread and a
slot for as long as it likes (the timeout is per read), authentication happens only once a thread
has the request, and an exhausted fd limit turns the accept loop into a busy spin.

Here one selector thread owns every connection that is not being served. It reads request heads,
and for listeners that ask it the (small) body too, under overall deadlines rather than per read;
it hands the head to the listener's `gate` (token, method, path, content type...) before anything
else; only a request that passed is given one of `max_workers` threads. Idle, slow and
unauthenticated clients therefore cost one fd each and no thread. At the connection cap (also
kept under the process's open-file limit) the oldest of those is closed to make room; when none
is old enough to close, the newcomer is answered 503 with `Retry-After`. A failed `accept` for
want of fds closes the oldest idle connection or answers through a reserved fd, then pauses
accepting briefly: never a spin. Handlers stay `http.server.BaseHTTPRequestHandler` subclasses, so
writing answers, chunked streams included, goes straight to the socket as before.
"""

from __future__ import annotations

import errno
import http.client
import io
import logging
import os
import re
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from queue import Empty, SimpleQueue
from typing import Any, Callable

log = logging.getLogger(__name__)

_RECV = 65536
_SWEEP_SECONDS = 0.25
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1024 * 1024
_ACCEPT_PAUSE_SECONDS = 0.1
_FD_HEADROOM = 64  # fds left to the rest of the process (VMs, files, SQLite) when sizing connection caps
_MIN_CONNECTIONS = 8
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_REQUEST_LINE = re.compile(rb"[A-Z]{1,20} [\x21-\x7e]{1,8000} HTTP/1\.[01]\r?\n")


def parse_decimal(text: str, max_digits: int = 18) -> int | None:
    """A number from outside: 1..max_digits ASCII digits, else None.

    int() alone also takes " 1_0" or "+5" and raises ValueError past 4,300 digits (a 500 where a
    400 is due); str.isdigit() alone takes "²", which int() then refuses.
    """
    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None


@dataclass(frozen=True)
class Limits:
    """What one listener allows; every time is an overall deadline, not a per-read timeout."""

    max_connections: int = 512  # sockets open at once: idle, reading a head, being served
    max_workers: int = 64  # threads serving requests (the listener's scarce slots)
    idle_seconds: float = 5.0  # a new or kept-alive connection's wait for its first byte
    head_seconds: float = 10.0  # request line and headers, from accept (or the previous answer)
    max_head_bytes: int = 64 * 1024
    body_seconds: float = 10.0  # grace for a body; it must then keep up body_min_rate on average
    body_min_rate: int = 64 * 1024  # bytes per second
    buffer_body_max: int = 0  # bodies up to this size are read by the selector, before a worker is taken
    max_buffered_bytes: int = 64 * 1024 * 1024  # all such bodies together
    evict_after_seconds: float = 1.0  # at the cap, a connection this old without a worker may be closed
    write_seconds: float = 120.0  # one send of an answer to a client that does not read
    retry_after_seconds: int = 5


@dataclass(frozen=True)
class Refusal:
    """An answer the selector sends itself, closing the connection after it."""

    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Head:
    """A request line and headers, read in full; `framing` is the refusal its body framing earns."""

    method: str
    target: str
    headers: http.client.HTTPMessage
    size: int  # bytes of request line, headers and blank line
    length: int | None  # the declared Content-Length
    chunked: bool
    framing: Refusal | None


def parse_head(data: bytes) -> Head | Refusal:
    """Parse a complete head (ending in its blank line) the way the worker's handler will."""
    line = _REQUEST_LINE.match(data)
    if not line:
        return Refusal(400, "malformed request line (expected: METHOD /target HTTP/1.1)")
    try:
        headers = http.client.parse_headers(io.BytesIO(data[line.end():]))
    except http.client.HTTPException as exc:
        return Refusal(431, f"request headers rejected: {exc}")
    method, target, _ = line.group().decode("ascii").split(" ", 2)
    lengths = headers.get_all("Content-Length") or []
    length = parse_decimal(lengths[0].strip()) if lengths else None
    codings = [v.strip().lower() for v in headers.get_all("Transfer-Encoding") or []]
    framing = None
    if lengths and (length is None or any(v.strip() != lengths[0].strip() for v in lengths)):
        framing = Refusal(400, "Content-Length must be one decimal number of at most 18 digits")
    elif codings and codings != ["chunked"]:
        framing = Refusal(501, "only Transfer-Encoding: chunked is supported")
    elif codings and lengths:
        framing = Refusal(400, "a request has either Content-Length or Transfer-Encoding, not both")
    return Head(method, target, headers, len(data), length, bool(codings), framing)


class _FdLedger:
    """File descriptors promised to listeners' connections, so two listeners never count on the same free ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._promised = 0

    def claim(self, wanted: int, name: str) -> int:
        with self._lock:
            in_use = len(os.listdir("/proc/self/fd"))
            need = in_use + self._promised + wanted + _FD_HEADROOM
            soft = _raise_nofile(need)
            granted = max(_MIN_CONNECTIONS, min(wanted, soft - need + wanted))
            if granted < wanted:
                log.warning("%s: only %d connections fit under the open-file limit of %d (wanted %d); "
                            "raise LimitNOFILE for the service", name, granted, soft, wanted)
            self._promised += granted
            return granted

    def release(self, count: int) -> None:
        with self._lock:
            self._promised -= count


def _raise_nofile(need: int) -> int:
    """Raise the soft open-file limit towards `need` (within the hard limit); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return need if soft == resource.RLIM_INFINITY else soft
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


_LEDGER = _FdLedger()


class _Reader:
    """A worker's view of the connection's input: what the selector read, then the socket.

    Every read shares one deadline: after `body_seconds` of grace the client must have sent
    `body_min_rate` bytes per second on average, however it spreads them over reads.
    """

    def __init__(self, sock: socket.socket, buffered: bytes, limits: Limits) -> None:
        self._sock, self._buf, self._limits = sock, bytearray(buffered), limits
        self._start = time.monotonic()
        self._received = 0
        self.consumed = 0

    def _fill(self) -> bool:
        limits = self._limits
        left = self._start + limits.body_seconds + self._received / limits.body_min_rate - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        data = self._sock.recv(_RECV * 16)
        self._received += len(data)
        self._buf += data
        return bool(data)

    def read(self, size: int) -> bytes:
        """Up to `size` bytes (fewer only when that is all there is now); b"" at the end of input."""
        if not self._buf and not self._fill():
            return b""
        return self._take(min(size, len(self._buf)))

    def readline(self, limit: int) -> bytes:
        start = 0
        while True:
            end = self._buf.find(b"\n", start, limit)
            if end >= 0:
                return self._take(end + 1)
            if len(self._buf) >= limit:
                return self._take(limit)
            start = len(self._buf)
            if not self._fill():
                return self._take(len(self._buf))

    def _take(self, size: int) -> bytes:
        data = bytes(self._buf[:size])
        del self._buf[:size]
        self.consumed += size
        return data

    def leftover(self) -> bytearray:
        return self._buf


class _Writer:
    """Answers go straight to the socket; each send has `write_seconds` to complete."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._seconds = sock, seconds

    def write(self, data: bytes) -> int:
        self._sock.settimeout(self._seconds)
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        """Nothing is buffered."""


class ServedRequest(BaseHTTPRequestHandler):
    """One request on a connection whose head the selector already read: `rfile` starts with it."""

    protocol_version = "HTTP/1.1"
    server: "BoundedHTTPServer"

    def __init__(self, sock: socket.socket, address: Any, server: "BoundedHTTPServer", reader: _Reader) -> None:
        self.reader = reader
        super().__init__(sock, address, server)

    def setup(self) -> None:
        self.connection = self.request
        self.rfile = self.reader  # type: ignore[assignment]
        self.wfile = _Writer(self.request, self.server.limits.write_seconds)  # type: ignore[assignment]

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()

    def finish(self) -> None:
        """The server decides whether the connection goes back to the selector."""

    def address_string(self) -> str:
        return str(self.client_address[0]) if self.client_address else "unix"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        log.debug("%s %s: " + format, self.server.name, self.address_string(), *args)

    def read_body(self, length: int) -> bytes:
        """Exactly `length` bytes of body, or ConnectionError when the client stops short."""
        parts, left = [], length
        while left:
            data = self.rfile.read(left)
            if not data:
                raise ConnectionResetError("the client closed the connection inside the body")
            parts.append(data)
            left -= len(data)
        return b"".join(parts)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    address: Any
    since: float  # when it (re-)entered the selector: eviction goes oldest first
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    state: str = "head"  # head | body | linger
    head: Head | None = None
    reserved: int = 0  # body bytes counted against max_buffered_bytes
    drained: int = 0


class BoundedHTTPServer:
    """Serve `handler` requests on a listening socket within `limits`; `gate` vets each head first."""

    def __init__(self, listener: socket.socket, handler: type[ServedRequest], limits: Limits, *, name: str,
                 error_body: Callable[[str], bytes], gate: Callable[[Head], Refusal | None] | None = None) -> None:
        self.listener, self.handler, self.name = listener, handler, name
        self.limits = replace(limits, max_connections=_LEDGER.claim(limits.max_connections, name))
        self.error_body = error_body
        self.gate = gate or (lambda head: None)
        listener.setblocking(False)
        self._workers = threading.BoundedSemaphore(limits.max_workers)
        self._loop_owned: OrderedDict[_Conn, None] = OrderedDict()
        self._open = 0
        self._buffered = 0
        self._returns: SimpleQueue[tuple[_Conn, bool]] = SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reserve: int | None = _open_reserve()
        self._selector = selectors.DefaultSelector()
        self._paused_until = 0.0
        self._stop = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._fd_warning_at = 0.0

    @property
    def address(self) -> Any:
        return self.listener.getsockname()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, close every connection the selector holds; requests being served finish alone."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drain_returns(close_all=True)
        for conn in list(self._loop_owned):
            self._close(conn)
        self._selector.close()
        self.listener.close()
        for fd in (self._wake_r, self._wake_w, self._reserve):
            if fd is not None:
                os.close(fd)
        _LEDGER.release(self.limits.max_connections)

    # -- the selector thread ----------------------------------------------------------------------

    def _run(self) -> None:
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(_SWEEP_SECONDS):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj == self._wake_r:
                        self._drain_returns()
                    else:
                        self._readable(key.data)
                now = time.monotonic()
                if now >= next_sweep:
                    self._expire(now)
                    next_sweep = now + _SWEEP_SECONDS
        except Exception:
            log.exception("%s: the connection loop failed; the listener is down", self.name)
            raise

    def _accept(self) -> None:
        for _ in range(64):  # then let the other connections have a turn
            try:
                sock, address = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._out_of_fds(exc)
                    return
                continue  # e.g. ECONNABORTED: that client is gone, the next one may not be
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        now = time.monotonic()
        if self._open >= self.limits.max_connections and not self._evict_oldest(now):
            self._refuse_fresh(sock, self._busy("too many connections"))
            return
        sock.setblocking(False)
        self._open += 1
        self._enter(_Conn(sock, address, since=now, deadline=now + self.limits.idle_seconds))

    def _out_of_fds(self, exc: OSError) -> None:
        """accept() failed for want of fds: free one of ours, or answer one client through the reserve; then pause."""
        now = time.monotonic()
        if now - self._fd_warning_at > 60:
            self._fd_warning_at = now
            log.warning("%s: accept failed (%s); closing idle connections and pausing accepts", self.name, exc.strerror)
        if self._evict_oldest(now):
            return
        if self._reserve is not None:  # one fd at a time: tell the waiting clients why, then let them go
            os.close(self._reserve)
            for _ in range(64):
                try:
                    sock, _ = self.listener.accept()
                except OSError:
                    break
                self._refuse_fresh(sock, self._busy("out of file descriptors"))
            self._reserve = _open_reserve()
        self._paused_until = now + _ACCEPT_PAUSE_SECONDS
        self._selector.unregister(self.listener)

    def _evict_oldest(self, now: float) -> bool:
        for conn in self._loop_owned:
            if now - conn.since < self.limits.evict_after_seconds:
                return False
            log.debug("%s: closing an old %s connection to make room", self.name, conn.state)
            self._close(conn)
            return True
        return False

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.state == "linger":
            conn.drained += len(data)
            if conn.drained > _LINGER_BYTES:
                self._close(conn)
            return
        if conn.state == "head" and not conn.buf:
            conn.deadline = conn.since + self.limits.head_seconds
        conn.buf += data
        self._progress(conn, len(data))

    def _progress(self, conn: _Conn, new: int) -> None:
        if conn.state == "head":
            end = _HEAD_END.search(conn.buf, max(0, len(conn.buf) - new - 3))
            if end is None:
                if len(conn.buf) > self.limits.max_head_bytes:
                    self._refuse(conn, Refusal(431, f"the request head is larger than {self.limits.max_head_bytes} bytes"))
                return
            head = parse_head(bytes(conn.buf[:end.end()]))
            if isinstance(head, Refusal):
                return self._refuse(conn, head)
            refusal = self.gate(head) or head.framing
            if refusal:
                return self._refuse(conn, refusal)
            conn.head = head
            if not head.length or head.length > self.limits.buffer_body_max:
                return self._dispatch(conn)
            if self._buffered + head.length > self.limits.max_buffered_bytes:
                return self._refuse(conn, self._busy("too many request bodies arriving at once"))
            conn.state, conn.reserved = "body", head.length
            self._buffered += head.length
            conn.deadline = time.monotonic() + self.limits.body_seconds + head.length / self.limits.body_min_rate
        if conn.state == "body" and conn.head and len(conn.buf) >= conn.head.size + conn.reserved:
            self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        if not self._workers.acquire(blocking=False):
            return self._refuse(conn, self._busy("every worker is busy"))
        self._leave(conn)
        conn.sock.setblocking(True)
        try:
            threading.Thread(target=self._serve, args=(conn,), name=f"{self.name}-worker", daemon=True).start()
        except RuntimeError:  # no thread could be started
            self._workers.release()
            conn.sock.setblocking(False)
            self._enter(conn)
            self._refuse(conn, self._busy("no thread available"))

    def _drain_returns(self, close_all: bool = False) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                conn, keep = self._returns.get_nowait()
            except Empty:
                return
            conn.sock.setblocking(False)
            if close_all:
                conn.sock.close()
                self._open -= 1
                continue
            now = time.monotonic()
            conn.state, conn.head, conn.since = "head", None, now
            conn.deadline = now + (self.limits.head_seconds if conn.buf else self.limits.idle_seconds)
            self._enter(conn)
            if not keep:
                self._linger(conn)
            elif conn.buf:
                self._progress(conn, len(conn.buf))  # a pipelined request already arrived

    def _expire(self, now: float) -> None:
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self.listener, selectors.EVENT_READ)
        for conn in [c for c in self._loop_owned if c.deadline <= now]:
            if conn.state in ("head", "body") and conn.buf:
                self._send_once(conn.sock, self._render(Refusal(408, "the request did not arrive in time")))
            self._close(conn)

    # -- connection bookkeeping -------------------------------------------------------------------

    def _enter(self, conn: _Conn) -> None:
        self._loop_owned[conn] = None
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _leave(self, conn: _Conn) -> None:
        self._selector.unregister(conn.sock)
        del self._loop_owned[conn]
        self._buffered -= conn.reserved
        conn.reserved = 0

    def _close(self, conn: _Conn) -> None:
        self._leave(conn)
        conn.sock.close()
        self._open -= 1

    def _refuse(self, conn: _Conn, refusal: Refusal) -> None:
        head_only = conn.buf.startswith(b"HEAD ")  # the buffer starts with the request being refused
        if self._send_once(conn.sock, self._render(refusal, head_only)):
            self._linger(conn)
        else:
            self._close(conn)

    def _linger(self, conn: _Conn) -> None:
        """Close our side but read what the client still sends for a moment, so it gets our answer, not a reset."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self._close(conn)
        self._buffered -= conn.reserved
        conn.state, conn.reserved, conn.buf = "linger", 0, bytearray()
        conn.deadline = min(conn.deadline, time.monotonic() + _LINGER_SECONDS)

    def _refuse_fresh(self, sock: socket.socket, refusal: Refusal) -> None:
        sock.setblocking(False)
        self._send_once(sock, self._render(refusal))
        sock.close()

    def _send_once(self, sock: socket.socket, data: bytes) -> bool:
        """One non-blocking send: a short answer fits the socket buffer, and the selector must never wait."""
        try:
            return sock.send(data) == len(data)
        except OSError:
            return False

    def _busy(self, why: str) -> Refusal:
        retry = str(self.limits.retry_after_seconds)
        return Refusal(503, f"{why}; try again in {retry} s", (("Retry-After", retry),))

    def _render(self, refusal: Refusal, head_only: bool = False) -> bytes:
        """The answer's bytes; to a HEAD request without the body (RFC 9110 9.3.2: a client reads none, so
        one sent would be taken for the next answer), as BaseHTTPRequestHandler answers HEAD too."""
        body = self.error_body(refusal.message)
        lines = [f"HTTP/1.1 {refusal.status} {HTTPStatus(refusal.status).phrase}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close",
                 *(f"{name}: {value}" for name, value in refusal.headers)]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake, or closing

    # -- worker threads ---------------------------------------------------------------------------

    def _serve(self, conn: _Conn) -> None:
        reader = _Reader(conn.sock, bytes(conn.buf), self.limits)
        keep = False
        try:
            handler = self.handler(conn.sock, conn.address, self, reader)
            head = conn.head
            keep = (not handler.close_connection and head is not None and not head.chunked
                    and reader.consumed == head.size + (head.length or 0))
        except (ConnectionError, TimeoutError) as exc:
            log.debug("%s: client %s went away: %s", self.name, conn.address or "unix", exc)
        except Exception:
            log.exception("%s: serving a request failed", self.name)
        finally:
            self._workers.release()
            conn.buf = reader.leftover()
            self._give_back(conn, keep)

    def _give_back(self, conn: _Conn, keep: bool) -> None:
        with self._lock:
            if self._closed:
                conn.sock.close()
                return
            self._returns.put((conn, keep))
        self._wake()


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)
