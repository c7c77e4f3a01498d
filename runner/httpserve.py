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
accepting briefly: never a spin.

The HTTP/1.1 itself (request line and headers, Content-Length and chunked bodies, keep-alive,
answers framed by Content-Length or chunked, HEAD and HTTP/1.0 peers) is h11's: a sans-IO state
machine per connection, fed by the selector and then by the worker. This module owns only the IO,
the deadlines and the caps around it.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.client import HTTPMessage
from queue import Empty, SimpleQueue
from typing import Any

import h11

from runner.errors import JobError

log = logging.getLogger(__name__)

_RECV = 65536
_SWEEP_SECONDS = 0.25
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1024 * 1024
_ACCEPT_PAUSE_SECONDS = 0.1
_FD_HEADROOM = 64  # fds left to the rest of the process (VMs, files, SQLite) when sizing connection caps
_MIN_CONNECTIONS = 8
_OUT_OF_FDS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_MAX_ERROR_TEXT = 200  # of h11's description of a malformed request, echoed in the 400
_CONTINUE = h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue")


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
    max_headers: int = 100
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
    """A request line and headers, as h11 parsed and validated them."""

    method: str
    target: str
    headers: HTTPMessage  # case-insensitive; get() gives the first value, get_all() every one

    @classmethod
    def of(cls, request: h11.Request) -> Head:
        headers = HTTPMessage()
        for name, value in request.headers:  # h11 checked both: a token, and text without CR, LF or NUL
            headers[name.decode("ascii")] = value.decode("latin-1")  # adds; never replaces
        return cls(request.method.decode("ascii"), request.target.decode("ascii"), headers)

    @property
    def length(self) -> int | None:
        """The declared Content-Length (h11 checked its digits and merged equal repeats)."""
        value = self.headers.get("Content-Length")
        return int(value) if value is not None else None


class BadRequestBody(JobError):
    """A request body whose framing h11 refused, or that ended short: the listener answers 400."""


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


class _Deadline:
    """A worker's reads of a request body share one deadline: after `body_seconds` of grace the client
    must have sent `body_min_rate` bytes per second on average, however it spreads them over reads."""

    def __init__(self, sock: socket.socket, limits: Limits) -> None:
        self._sock, self._limits = sock, limits
        self._start = time.monotonic()
        self._received = 0

    def recv(self) -> bytes:
        limits = self._limits
        left = self._start + limits.body_seconds + self._received / limits.body_min_rate - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left)
        data = self._sock.recv(_RECV * 16)
        self._received += len(data)
        return data


class ServedRequest:
    """One request, served on a worker thread: `do_<METHOD>` answers it (as in http.server).

    The head was read (and for small bodies the body too) by the connection loop; `body()` reads the
    rest through h11 under the body deadline. An answer is `respond()`, or `start_response()`,
    `send_data()`... `end_response()` for a stream (chunked unless a Content-Length is given). An
    answer sent before the body was read whole says `Connection: close`, and the connection is closed.
    """

    def __init__(self, server: BoundedHTTPServer, conn: _Conn) -> None:
        assert conn.head is not None
        self.server, self.head, self.client_address = server, conn.head, conn.address
        self.command, self.path, self.headers = conn.head.method, conn.head.target, conn.head.headers
        self.close_connection = False  # set by a handler that wants the connection closed after its answer
        self._parser, self._sock, self._buffered = conn.parser, conn.sock, conn.body
        self._deadline = _Deadline(conn.sock, server.limits)
        if not self._buffered and self.head.length in (0, None) and "Transfer-Encoding" not in self.headers:
            self._next()  # the EndOfMessage of an empty body, so the request counts as read whole

    def handle(self) -> None:
        action = getattr(self, f"do_{self.command}", None)
        if action is None:
            self.respond(501, self.server.error_body(f"Unsupported method ({self.command!r})"),
                         {"Content-Type": "application/json"})
        else:
            action()

    def finish(self) -> bool:
        """Whether the connection may carry another request: both sides done, and h11 agrees."""
        if self._parser.our_state is h11.DONE and self._parser.their_state is h11.DONE:
            self._parser.start_next_cycle()
            return True
        return False

    def body(self) -> Iterator[bytes]:
        """The request body piece by piece; BadRequestBody when its framing is broken or it stops short."""
        if self._buffered:
            yield from self._buffered  # the connection loop read it whole
            return
        while isinstance(event := self._next(), h11.Data):
            yield event.data

    def _next(self) -> Any:
        while True:
            try:
                event = self._parser.next_event()
            except h11.RemoteProtocolError as exc:
                raise BadRequestBody(_describe(exc)) from None
            if event is not h11.NEED_DATA:
                return event
            if self._parser.they_are_waiting_for_100_continue:
                self._send(_CONTINUE)
            self._parser.receive_data(self._deadline.recv())  # b"" at the end of input: h11 then raises

    def respond(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        """A whole answer with its Content-Length, in one write (to HEAD: the head alone, RFC 9110 9.3.2)."""
        head = self._head(status, {**headers, "Content-Length": str(len(body))})
        self._send(head, *([h11.Data(data=body)] if body and self.command != "HEAD" else []), h11.EndOfMessage())

    def start_response(self, status: int, headers: Mapping[str, str]) -> None:
        self._send(self._head(status, headers))

    def send_data(self, data: bytes) -> None:
        if data:
            self._send(h11.Data(data=data))

    def end_response(self) -> None:
        self._send(h11.EndOfMessage())

    def _head(self, status: int, headers: Mapping[str, str]) -> h11.Response:
        items = list(headers.items())
        if self.close_connection or self._parser.their_state is not h11.DONE:
            items.append(("Connection", "close"))  # the unread rest of a body cannot be told from a request
        log.debug("%s %s: %s %s -> %d", self.server.name, self.address_string(), self.command, self.path, status)
        return h11.Response(status_code=status, headers=items, reason=HTTPStatus(status).phrase.encode())

    def _send(self, *events: Any) -> None:
        """Straight to the socket, in one write; each write has `write_seconds` to complete."""
        data = b"".join(self._parser.send(event) or b"" for event in events)
        if data:
            self._sock.settimeout(self.server.limits.write_seconds)
            self._sock.sendall(data)

    def address_string(self) -> str:
        return str(self.client_address[0]) if self.client_address else "unix"


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    address: Any
    since: float  # when it (re-)entered the selector: eviction goes oldest first
    deadline: float
    parser: h11.Connection  # this connection's HTTP/1.1 state, handed to the worker with it
    state: str = "head"  # head | body | linger
    prefix: bytes = b""  # the request's first bytes: a refusal to HEAD carries no body, even one h11 could not parse
    head: Head | None = None
    body: list[bytes] = field(default_factory=list)  # read by the loop, for listeners with buffer_body_max
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
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_bytes)
        self._enter(_Conn(sock, address, since=now, deadline=now + self.limits.idle_seconds, parser=parser))

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
        if conn.state == "head" and len(conn.prefix) < 5:
            if not conn.prefix:
                conn.deadline = conn.since + self.limits.head_seconds
            conn.prefix += data[:5 - len(conn.prefix)]
        conn.parser.receive_data(data)
        self._progress(conn)

    def _progress(self, conn: _Conn) -> None:
        """Take what h11 can make of the bytes so far: a head to vet, body data to keep, or nothing yet."""
        while True:
            try:
                event = conn.parser.next_event()
            except h11.RemoteProtocolError as exc:
                return self._refuse(conn, _malformed(exc, self.limits))
            if isinstance(event, h11.Request):
                conn.head = Head.of(event)
                refusal = self._vet(conn.head)
                if refusal:
                    return self._refuse(conn, refusal)
                length = conn.head.length
                if not length or length > self.limits.buffer_body_max:
                    return self._dispatch(conn)
                if self._buffered + length > self.limits.max_buffered_bytes:
                    return self._refuse(conn, self._busy("too many request bodies arriving at once"))
                conn.state, conn.reserved = "body", length
                self._buffered += length
                conn.deadline = time.monotonic() + self.limits.body_seconds + length / self.limits.body_min_rate
                if conn.parser.they_are_waiting_for_100_continue:  # the head passed: the body may come
                    self._send_once(conn.sock, conn.parser.send(_CONTINUE))
            elif isinstance(event, h11.Data):
                conn.body.append(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return self._dispatch(conn)
            else:
                return  # NEED_DATA

    def _vet(self, head: Head) -> Refusal | None:
        """Our rules on top of h11's: a bound on header lines, the listener's gate, unambiguous framing."""
        if len(head.headers) > self.limits.max_headers:
            return Refusal(431, f"request headers rejected: got more than {self.limits.max_headers} headers")
        refusal = self.gate(head)
        if refusal is None and "Transfer-Encoding" in head.headers and head.length is not None:
            # h11 would follow Transfer-Encoding; RFC 9112 6.1 lets a server refuse, and smuggling needs both
            return Refusal(400, "a request has either Content-Length or Transfer-Encoding, not both")
        return refusal

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
            pending = conn.parser.trailing_data[0][:5] if keep else b""  # a pipelined request already arrived
            conn.state, conn.head, conn.body, conn.prefix, conn.since = "head", None, [], pending, now
            conn.deadline = now + (self.limits.head_seconds if pending else self.limits.idle_seconds)
            self._enter(conn)
            if not keep:
                self._linger(conn)
            elif pending:
                self._progress(conn)

    def _expire(self, now: float) -> None:
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._selector.register(self.listener, selectors.EVENT_READ)
        for conn in [c for c in self._loop_owned if c.deadline <= now]:
            if conn.state in ("head", "body") and conn.prefix:
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
        if self._send_once(conn.sock, self._render(refusal, head_only=conn.prefix == b"HEAD ")):
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
        conn.state, conn.reserved, conn.body = "linger", 0, []
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
        """The answer's bytes, framed by a fresh h11 connection (h11 allows an answer to a request it never
        parsed); to a HEAD request without the body (RFC 9110 9.3.2: a client reads none, so one sent would be
        taken for the next answer), as ServedRequest answers HEAD too."""
        body = self.error_body(refusal.message)
        framer = h11.Connection(h11.SERVER)
        head = framer.send(h11.Response(
            status_code=refusal.status, reason=HTTPStatus(refusal.status).phrase.encode(),
            headers=[("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Connection", "close"),
                     *refusal.headers]))
        return head if head_only else head + framer.send(h11.Data(data=body)) + framer.send(h11.EndOfMessage())

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake, or closing

    # -- worker threads ---------------------------------------------------------------------------

    def _serve(self, conn: _Conn) -> None:
        keep = False
        try:
            request = self.handler(self, conn)
            request.handle()
            keep = request.finish()
        except (ConnectionError, TimeoutError) as exc:
            log.debug("%s: client %s went away: %s", self.name, conn.address or "unix", exc)
        except Exception:
            log.exception("%s: serving a request failed", self.name)
        finally:
            self._workers.release()
            self._give_back(conn, keep)

    def _give_back(self, conn: _Conn, keep: bool) -> None:
        with self._lock:
            if self._closed:
                conn.sock.close()
                return
            self._returns.put((conn, keep))
        self._wake()


def _malformed(exc: h11.RemoteProtocolError, limits: Limits) -> Refusal:
    """h11's verdict on bytes that are not an HTTP/1.1 request, in words a client can act on."""
    if exc.error_status_hint == 431:
        return Refusal(431, f"the request head is larger than {limits.max_head_bytes} bytes")
    if exc.error_status_hint == 501:
        return Refusal(501, "only Transfer-Encoding: chunked is supported")
    return Refusal(400, f"malformed request: {_describe(exc)}")


def _describe(exc: h11.RemoteProtocolError) -> str:
    return str(exc)[:_MAX_ERROR_TEXT]


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)
