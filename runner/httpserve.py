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

A request that passed its gate while every worker is busy waits for one as an fd in a FIFO (up to
`wait_seconds`), not as a 503; `reserved_workers` are kept for the listener's `urgent` requests (the
fleet's hooks), so those are always served. Long answers (a job's log stream) are handed to one
stream thread after their head: it copies what the stream has ready to every such connection,
non-blocking, so a client following a queued job's log costs an fd and no worker. Unauthenticated
work is bounded per peer (its IP, or its uid on a Unix socket): connections still in the loop, the
bodies it reads at once, and the bytes of its buffered bodies until their answers begin. The last
covers what a handler does with a body before answering, such as parsing it: a JSON parse holds the
interpreter lock, so one peer's many large bodies parsed at once would starve the loop itself, and
with it every other client. A body past its peer's budget waits for room, unread, in the order it
came (its peer's bodies that lag behind the minimum rate are closed first; a listener may let small
bodies, cheap to handle, never wait); past the listener's budget, the slowest senders of any peer
are closed first.

The HTTP/1.1 itself (request line and headers, Content-Length and chunked bodies, keep-alive,
answers framed by Content-Length or chunked, HEAD and HTTP/1.0 peers) is h11's: a sans-IO state
machine per connection, fed by the selector and then by the worker. This module owns only the IO,
the deadlines and the caps around it.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import os
import re
import resource
import selectors
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.client import HTTPMessage
from queue import Empty, SimpleQueue
from typing import Any, Literal, Protocol

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
_PUMP_TICK_SECONDS = 0.25  # the stream thread's longest sleep; streams wake it when they have more
_PUMP_ALL_SECONDS = 1.0  # between wakes, every stream is read this often (its heartbeat, a missed wake)
_PUMP_IDLE_SECONDS = 1.0  # the stream thread ends after this long without streams
_PUMP_MAX_PENDING = 1024 * 1024  # bytes of an answer stream queued for a client that does not read
_PUMP_MAX_UNREAD = 64 * 1024  # bytes a client may send (pipeline) while its stream runs
_AGE_FLOOR_SECONDS = 1.0  # a body younger than this is rated as if it had been sending for this long
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
class ServerLimits:
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
    wait_seconds: float = 60.0  # a request that passed its gate waits this long for a worker, then 503
    max_waiting: int = 1024  # requests waiting for a worker at once (each an fd)
    reserved_workers: int = 0  # of max_workers, kept for the listener's `urgent` requests
    max_per_peer: int = 256  # connections of one peer still in the loop (idle, head, body)
    max_bodies_per_peer: int = 1024  # bodies of one peer the loop reads at once
    # the declared bytes of one peer's buffered bodies from their head until their answer begins: being
    # read, waiting for a worker, and handled (a JSON body's parse) on one; past it a body waits its turn
    max_body_bytes_per_peer: int = 64 * 1024 * 1024
    small_body_max: int = 0  # a body up to this size counts in that budget but never waits for it (cheap to handle)
    allow_sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()  # empty: every source


@dataclass(frozen=True)
class Refusal:
    """An answer the selector sends itself, closing the connection after it."""

    status: int
    message: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Peer:
    """Who is at the other end, as far as the connection tells: `key` is the IP, or "uid N" on a Unix socket."""

    key: str
    sock: socket.socket


@dataclass(frozen=True)
class Head:
    """A request line and headers, as h11 parsed and validated them, and the peer that sent them."""

    method: str
    target: str
    headers: HTTPMessage  # case-insensitive; get() gives the first value, get_all() every one
    peer: Peer | None = None

    @classmethod
    def of(cls, request: h11.Request, peer: Peer | None = None) -> Head:
        headers = HTTPMessage()
        for name, value in request.headers:  # h11 checked both: a token, and text without CR, LF or NUL
            headers[name.decode("ascii")] = value.decode("latin-1")  # adds; never replaces
        return cls(request.method.decode("ascii"), request.target.decode("ascii"), headers, peer)

    @property
    def length(self) -> int | None:
        """The declared Content-Length (h11 checked its digits and merged equal repeats)."""
        value = self.headers.get("Content-Length")
        return int(value) if value is not None else None


class Stream(Protocol):
    """A long answer's body, read without blocking by the stream thread (`ServedRequest.hand_off`).

    `watch(wake)` asks the stream to call `wake` (from any thread, never blocking) when more may be
    read; `unwatch(wake)` when the answer is done. Between wakes it is read once a second (heartbeats)."""

    def read(self) -> tuple[bytes, bool]:
        """What is ready now (possibly b""), and whether the answer is complete after it."""
        ...

    def watch(self, wake: Callable[[], None]) -> None: ...

    def unwatch(self, wake: Callable[[], None]) -> None: ...


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

    def __init__(self, sock: socket.socket, limits: ServerLimits) -> None:
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
        self._conn, self._holding = conn, conn.held > 0  # its buffered body still counts against its peer
        self._deadline = _Deadline(conn.sock, server.limits)
        self.handed_off: Stream | None = None
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
        """The request body piece by piece; BadRequestBody when its framing is broken or it stops short.

        A body already read to its end (the loop's buffered body, or an empty one, whose end was taken
        with the head) is not read again: h11 would wait for the next request's bytes. A body whose
        framing failed before still raises."""
        if self._buffered:
            yield from self._buffered  # the connection loop read it whole
            return
        if self._parser.their_state in (h11.DONE, h11.MUST_CLOSE):  # MUST_CLOSE: ended, with Connection: close
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

    def hand_off(self, stream: Stream) -> None:
        """After `start_response`: the rest of the answer is `stream`'s, copied by the listener's stream
        thread, and this request's worker is free as soon as the handler returns."""
        self.handed_off = stream

    def _head(self, status: int, headers: Mapping[str, str]) -> h11.Response:
        if self._holding:  # the answer begins: the body, and whatever parsed it, is done with
            self._holding = False
            self.server._budgets.unhold(self._conn)
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
    peer: str = ""  # Peer.key: what per-peer limits count
    state: str = "head"  # head | body | room | linger | wait: room (for its peer's body budget) and wait (for a
    # worker) are out of the selector, their bodies unread
    body_start: float = 0.0
    received: int = 0  # body bytes read by the loop
    last_data: bytes = b""  # the latest bytes read: to tell a 20-digit Content-Length from a garbled one
    prefix: bytes = b""  # the request's first bytes: a refusal to HEAD carries no body, even one h11 could not parse
    head: Head | None = None
    body: list[bytes] = field(default_factory=list)  # read by the loop, for listeners with buffer_body_max
    reserved: int = 0  # body bytes counted against max_buffered_bytes
    held: int = 0  # body bytes counted against its peer's max_body_bytes_per_peer (until its answer begins)
    drained: int = 0

    def rate(self, now: float) -> float:
        """Its body's bytes per second so far, as if it had been sending for at least _AGE_FLOOR_SECONDS."""
        return self.received / max(now - self.body_start, _AGE_FLOOR_SECONDS)

    def lagging(self, now: float, min_rate: int) -> bool:
        """Sending slower than `min_rate` since its start, judged once it is _AGE_FLOOR_SECONDS old."""
        age = now - self.body_start
        return age >= _AGE_FLOOR_SECONDS and self.received < age * min_rate

    def too_slow(self, now: float, limits: ServerLimits) -> bool:
        """A body the loop reads must keep up `body_min_rate` after its grace, all along (not only by its deadline)."""
        if self.state != "body":
            return False
        late = now - self.body_start - limits.body_seconds
        return late > 0 and self.received < late * limits.body_min_rate


class BoundedHTTPServer:
    """Serve `handler` requests on a listening socket within `limits`; `gate` vets each head first, and
    `urgent` says which requests may take the reserved workers (and go first when all are busy).

    This class is the selector thread: it reads heads (and small bodies), vets and dispatches them and
    keeps the connections it holds under their deadlines. Who gets a connection is `_Acceptor`'s, the
    bodies' budgets `_BodyBudgets`', the answering `_Workers`' (and its `_StreamPump`'s)."""

    def __init__(self, listener: socket.socket, handler: type[ServedRequest], limits: ServerLimits, *, name: str,
                 error_body: Callable[[str], bytes], gate: Callable[[Head], Refusal | None] | None = None,
                 urgent: Callable[[Head], bool] | None = None) -> None:
        self.listener, self.handler, self.name = listener, handler, name
        self.limits = replace(limits, max_connections=_LEDGER.claim(limits.max_connections, name))
        self.error_body = error_body
        self.gate = gate or (lambda head: None)
        self.urgent = urgent or (lambda head: False)
        listener.setblocking(False)
        self._loop_owned: OrderedDict[_Conn, None] = OrderedDict()
        self._per_peer: Counter[str] = Counter()  # loop-owned connections by peer
        self._open = 0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._budgets = _BodyBudgets(self.limits, self._wake, self._give_way)
        self._workers = _Workers(self)
        self._acceptor = _Acceptor(self)

    @property
    def address(self) -> Any:
        return self.listener.getsockname()

    def stats(self) -> dict[str, int]:
        """Connections open, workers busy, requests waiting for one, answers being streamed: for benchmarks."""
        return {"connections": self._open, "workers": self._workers.busy, "waiting": self._workers.waiting,
                "streams": self._workers.pump.count}

    def start(self) -> None:
        limits = self.limits
        log.info("%s: at most %d connections and %d worker threads (%d kept for urgent requests); log streams "
                 "and waiting requests cost an fd each, no thread", self.name, limits.max_connections,
                 limits.max_workers, limits.reserved_workers)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, close every connection the selector holds; requests being served finish alone."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join()
        if not self._workers.close():
            return
        self._drain_returns(close_all=True)
        for conn in list(self._loop_owned):
            self._close(conn)
        self._selector.close()
        self.listener.close()
        self._acceptor.close()
        for fd in (self._wake_r, self._wake_w):
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
                        self._acceptor.accept()
                    elif key.fileobj == self._wake_r:
                        self._drain_returns()
                    elif key.data in self._loop_owned:  # not closed by an eviction earlier in this batch
                        self._readable(key.data)
                self._workers.start_waiting()
                self._admit_room()
                now = time.monotonic()
                if now >= next_sweep:
                    self._expire(now)
                    next_sweep = now + _SWEEP_SECONDS
        except Exception:
            log.exception("%s: the connection loop failed; the listener is down", self.name)
            raise

    def _evict_oldest(self, now: float, peer: str | None = None) -> bool:
        """Close a connection in the loop (of `peer`, when given) to make room: one already answered and
        lingering, else the oldest; False when none is old enough."""
        for conn in self._loop_owned:
            if conn.state == "linger" and (peer is None or conn.peer == peer):
                self._close(conn)
                return True
        for conn in self._loop_owned:
            if peer is not None and conn.peer != peer:
                continue
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
            if conn.state == "body":  # a body cut short by a half-close: the sender is owed an answer
                return self._refuse(conn, Refusal(400, "the request body ended before its Content-Length"))
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
        conn.last_data = data
        conn.parser.receive_data(data)
        self._progress(conn)

    def _progress(self, conn: _Conn) -> None:
        """Take what h11 can make of the bytes so far: a head to vet, body data to keep, or nothing yet."""
        while True:
            try:
                event = conn.parser.next_event()
            except h11.RemoteProtocolError as exc:
                return self._refuse(conn, _malformed(exc, self.limits, conn.last_data))
            if isinstance(event, h11.Request):
                conn.head = Head.of(event, Peer(conn.peer, conn.sock))
                refusal = self._vet(conn.head)
                if refusal:
                    return self._refuse(conn, refusal)
                length = conn.head.length
                if not length or length > self.limits.buffer_body_max or conn.head.method in ("GET", "HEAD"):
                    return self._dispatch(conn)  # a GET's body means nothing (RFC 9110 9.3.1): answered unread
                queued = self._budgets.waits(conn.peer) and length > self.limits.small_body_max  # behind its peer's
                room = "wait" if queued else self._budgets.make_room(conn, length)
                if room == "wait":
                    self._selector.unregister(conn.sock)  # its body left in the socket: the client is held back
                    return self._budgets.wait(conn)
                if room is not None:
                    return self._refuse(conn, room)
                self._budgets.read(conn, length)
            elif isinstance(event, h11.Data):
                conn.body.append(event.data)
                conn.received += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return self._dispatch(conn)
            else:
                return  # NEED_DATA

    def _give_way(self, conn: _Conn) -> None:
        log.debug("%s: closing the slowest body being read (%d bytes) to make room", self.name, conn.received)
        self._refuse(conn, _busy(self.limits, "the request body arrived too slowly while others waited"))

    def _admit_room(self) -> None:
        """Start the waiting bodies of the peers whose budget got room, first come first."""
        for peer in self._budgets.take_freed():
            while (conn := self._budgets.first_waiting(peer)) is not None:
                assert conn.head is not None and conn.head.length
                room = self._budgets.make_room(conn, conn.head.length)
                if room == "wait":
                    break
                self._resume(conn)
                if room is not None:
                    self._refuse(conn, room)
                    continue
                self._budgets.read(conn, conn.head.length)
                self._progress(conn)  # what arrived with its head, which nothing has read yet

    def _resume(self, conn: _Conn) -> None:
        """Out of its peer's wait, back in the selector."""
        self._budgets.leave_room(conn)
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

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
        """A worker for a request that passed its gate, or a place in the wait for one (an fd, no thread)."""
        assert conn.head is not None
        urgent = self.urgent(conn.head)
        if self._workers.take(urgent):
            self._leave(conn)
            return self._workers.start(conn)
        if self._workers.waiting >= self.limits.max_waiting:
            return self._refuse(conn, _busy(self.limits, "every worker is busy"))
        self._unwatch(conn)  # its body, if any, stays in the socket until a worker reads it
        conn.state, conn.deadline = "wait", time.monotonic() + self.limits.wait_seconds
        self._workers.wait(conn, urgent)

    def _drain_returns(self, close_all: bool = False) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        for conn, keep in self._workers.returned():
            self._budgets.unhold(conn)  # its request ended; normally its answer's start already let go of its body
            if keep is None:  # the stream thread closed it
                self._open -= 1
                continue
            conn.sock.setblocking(False)
            if close_all:
                conn.sock.close()
                self._open -= 1
                continue
            now = time.monotonic()
            pending = conn.parser.trailing_data[0][:5] if keep else b""  # a pipelined request already arrived
            conn.state, conn.head, conn.body, conn.prefix, conn.since = "head", None, [], pending, now
            conn.received = 0
            conn.deadline = now + (self.limits.head_seconds if pending else self.limits.idle_seconds)
            self._enter(conn)
            if not keep:
                self._linger(conn)
            elif pending:
                self._progress(conn)

    def _expire(self, now: float) -> None:
        self._acceptor.resume(now)
        limits = self.limits
        self._budgets.note_lagging(now)
        for conn in [c for c in self._loop_owned if c.deadline <= now or c.too_slow(now, limits)]:
            if conn.state == "room":
                self._refuse(conn, _busy(limits, f"the request body waited {limits.wait_seconds:g} s for its "
                                                 "peer's earlier bodies"))
                continue
            if conn.state in ("head", "body") and conn.prefix:
                _send_once(conn.sock, _render(Refusal(408, "the request did not arrive in time"), self.error_body))
            self._close(conn)
        self._workers.expire(now)

    # -- connection bookkeeping -------------------------------------------------------------------

    def _enter(self, conn: _Conn) -> None:
        self._loop_owned[conn] = None
        self._per_peer[conn.peer] += 1
        self._selector.register(conn.sock, selectors.EVENT_READ, conn)

    def _unwatch(self, conn: _Conn) -> None:
        """Out of the selector (or its peer's wait) and the per-peer counts; its body reservation and its
        peer's hold on it, if any, stay."""
        if conn.state == "room":
            self._budgets.leave_room(conn)
        else:
            self._selector.unregister(conn.sock)
        del self._loop_owned[conn]
        self._per_peer[conn.peer] -= 1
        if self._per_peer[conn.peer] <= 0:
            del self._per_peer[conn.peer]
        self._budgets.stop_reading(conn)

    def _leave(self, conn: _Conn) -> None:
        self._unwatch(conn)
        self._budgets.release(conn)

    def _close(self, conn: _Conn) -> None:
        self._leave(conn)
        self._budgets.unhold(conn)
        conn.sock.close()
        self._open -= 1

    def _refuse(self, conn: _Conn, refusal: Refusal) -> None:
        if _send_once(conn.sock, _render(refusal, self.error_body, head_only=conn.prefix == b"HEAD ")):
            self._linger(conn)
        else:
            self._close(conn)

    def _linger(self, conn: _Conn) -> None:
        """Close our side but read what the client still sends for a moment, so it gets our answer, not a reset."""
        if conn.state == "room":
            self._resume(conn)  # to read what it still sends
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self._close(conn)
        self._budgets.stop_reading(conn)
        self._budgets.unhold(conn)
        self._budgets.release(conn)
        conn.state, conn.body = "linger", []
        conn.deadline = min(conn.deadline, time.monotonic() + _LINGER_SECONDS)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # already awake, or closing


class _Acceptor:
    """Who gets a connection: a source the listener serves, within the connection caps (of one peer, and
    of all), an old connection closed to make room when one may be. When `accept` fails for want of fds,
    one of ours is closed, or the waiting clients are told why through a reserved fd; then accepting
    pauses for a moment: never a busy spin."""

    def __init__(self, server: BoundedHTTPServer) -> None:
        self._server, self._limits = server, server.limits
        self._reserve: int | None = _open_reserve()
        self._paused_until = 0.0
        self._fd_warning_at = 0.0

    def accept(self) -> None:
        listener = self._server.listener
        for _ in range(64):  # then let the other connections have a turn
            try:
                sock, address = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._out_of_fds(exc)
                    return
                continue  # e.g. ECONNABORTED: that client is gone, the next one may not be
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: Any) -> None:
        server, limits = self._server, self._limits
        now = time.monotonic()
        peer = _peer_key(sock, address)
        if not _source_allowed(address, limits.allow_sources):
            sock.close()  # not a source this listener serves: not even an answer
            return
        if server._per_peer[peer] >= limits.max_per_peer and not server._evict_oldest(now, peer):
            self._refuse(sock, _busy(limits, "too many connections from one peer"))
            return
        if server._open >= limits.max_connections and not server._evict_oldest(now):
            self._refuse(sock, _busy(limits, "too many connections"))
            return
        sock.setblocking(False)
        server._open += 1
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        server._enter(_Conn(sock, address, since=now, deadline=now + limits.idle_seconds, parser=parser, peer=peer))

    def _out_of_fds(self, exc: OSError) -> None:
        """accept() failed for want of fds: free one of ours, or answer one client through the reserve; then pause."""
        server = self._server
        now = time.monotonic()
        if now - self._fd_warning_at > 60:
            self._fd_warning_at = now
            log.warning("%s: accept failed (%s); closing idle connections and pausing accepts", server.name,
                        exc.strerror)
        if server._evict_oldest(now):
            return
        if self._reserve is not None:  # one fd at a time: tell the waiting clients why, then let them go
            os.close(self._reserve)
            for _ in range(64):
                try:
                    sock, _ = server.listener.accept()
                except OSError:
                    break
                self._refuse(sock, _busy(self._limits, "out of file descriptors"))
            self._reserve = _open_reserve()
        self._paused_until = now + _ACCEPT_PAUSE_SECONDS
        server._selector.unregister(server.listener)

    def resume(self, now: float) -> None:
        """Accept again once the pause after running out of fds is over."""
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._server._selector.register(self._server.listener, selectors.EVENT_READ)

    def _refuse(self, sock: socket.socket, refusal: Refusal) -> None:
        """A connection never let in: the answer, if the socket takes it at once, and closed."""
        sock.setblocking(False)
        _send_once(sock, _render(refusal, self._server.error_body))
        sock.close()

    def close(self) -> None:
        if self._reserve is not None:
            os.close(self._reserve)


class _BodyBudgets:
    """The bytes of the bodies the loop reads itself (listeners with buffer_body_max), in two budgets: each
    peer's (`max_body_bytes_per_peer`, from a body's head until its answer begins: being read, waiting for
    a worker, handled) and the listener's (`max_buffered_bytes`, until a worker takes it); and each peer's
    FIFO of bodies waiting, unread, for room in its own.

    The loop thread reads, reserves and waits; a worker lets go of its body (`unhold`) as its answer
    begins, so the held bytes and the peers that got room (`freed`) are under a lock."""

    def __init__(self, limits: ServerLimits, wake: Callable[[], None], give_way: Callable[[_Conn], None]) -> None:
        self._limits, self._wake, self._give_way = limits, wake, give_way
        self._buffered = 0  # reserved against max_buffered_bytes
        self._reading: dict[str, list[_Conn]] = {}  # bodies being read, by peer
        self._held: Counter[str] = Counter()  # body bytes by peer, from head until answer (`_lock`)
        self._room: dict[str, deque[_Conn]] = {}  # bodies waiting for room in their peer's budget (FIFO)
        self._freed: set[str] = set()  # peers whose budget got room since the loop last looked (`_lock`)
        self._lock = threading.Lock()

    def make_room(self, conn: _Conn, length: int) -> Refusal | Literal["wait"] | None:
        """Room for a body of `length` in its peer's and the listener's budgets; None when it fits now.

        Over its peer's budget, that peer's slowest body being read gives way if it lags behind
        body_min_rate; else the body waits ("wait"): a peer's bodies that keep up never push each other
        out. Over the listener's, the slowest body being read of any peer gives way (they passed only
        the head's checks); with none being read, a 503."""
        limits = self._limits
        if length > limits.max_body_bytes_per_peer or length > limits.max_buffered_bytes:
            return _busy(limits, "the request body is larger than this listener buffers")
        now = time.monotonic()
        while self._peer_full(conn.peer, length):
            lagging = [c for c in self._reading.get(conn.peer, []) if c.lagging(now, limits.body_min_rate)]
            if not lagging:
                return "wait"
            self._give_way(min(lagging, key=lambda c: c.rate(now)))
        while self._buffered + length > limits.max_buffered_bytes:
            candidates = [c for bodies in self._reading.values() for c in bodies]
            if not candidates:
                return _busy(limits, "too many request bodies arriving at once")
            self._give_way(min(candidates, key=lambda c: c.rate(now)))
        return None

    def _peer_full(self, peer: str, length: int) -> bool:
        limits = self._limits
        return (len(self._reading.get(peer, ())) >= limits.max_bodies_per_peer
                or (length > limits.small_body_max and self._held[peer] + length > limits.max_body_bytes_per_peer))

    def read(self, conn: _Conn, length: int) -> None:
        """The loop reads the body of a head that passed, counted against its peer's and the listener's budgets."""
        now = time.monotonic()
        conn.state, conn.reserved, conn.body_start = "body", length, now
        self._buffered += length
        with self._lock:
            conn.held = length
            self._held[conn.peer] += length
        self._reading.setdefault(conn.peer, []).append(conn)
        conn.deadline = now + self._limits.body_seconds + length / self._limits.body_min_rate
        if conn.parser.they_are_waiting_for_100_continue:  # the head passed: the body may come
            _send_once(conn.sock, conn.parser.send(_CONTINUE))

    def wait(self, conn: _Conn) -> None:
        """Its peer's budget is full of bodies that keep up, or others of its wait already: it waits its turn
        (up to wait_seconds), out of the selector, so the client is held back rather than refused."""
        conn.state, conn.deadline = "room", time.monotonic() + self._limits.wait_seconds
        self._room.setdefault(conn.peer, deque()).append(conn)

    def waits(self, peer: str) -> bool:
        """Whether bodies of `peer` wait for room: a newcomer queues behind them."""
        return peer in self._room

    def take_freed(self) -> set[str]:
        """The peers whose budget got room since the last call."""
        with self._lock:
            freed, self._freed = self._freed, set()
        return freed

    def first_waiting(self, peer: str) -> _Conn | None:
        queue = self._room.get(peer)
        return queue[0] if queue else None

    def leave_room(self, conn: _Conn) -> None:
        queue = self._room[conn.peer]
        queue.remove(conn)
        if not queue:
            del self._room[conn.peer]
        conn.state = "head"

    def note_lagging(self, now: float) -> None:
        """A body that lags by now gives way to its peer's waiting ones: their peer is looked at again."""
        lagging = {peer for peer in self._room
                   if any(c.lagging(now, self._limits.body_min_rate) for c in self._reading.get(peer, ()))}
        if lagging:
            with self._lock:
                self._freed |= lagging

    def stop_reading(self, conn: _Conn) -> None:
        """No longer among the bodies its peer's loop reads at once: one of its waiting bodies may start."""
        bodies = self._reading.get(conn.peer)
        if bodies is not None and conn in bodies:
            bodies.remove(conn)
            if not bodies:
                del self._reading[conn.peer]
            if conn.peer in self._room:
                with self._lock:
                    self._freed.add(conn.peer)

    def release(self, conn: _Conn) -> None:
        """Its body leaves the listener's budget: a worker has it, or it ended."""
        self._buffered -= conn.reserved
        conn.reserved = 0

    def unhold(self, conn: _Conn) -> None:
        """Its body leaves its peer's budget: its answer began (from its worker), or it ended unanswered."""
        with self._lock:
            if not conn.held:
                return
            self._held[conn.peer] -= conn.held
            if self._held[conn.peer] <= 0:
                del self._held[conn.peer]
            conn.held = 0
            self._freed.add(conn.peer)
        self._wake()


class _Workers:
    """The threads that answer: at most `max_workers` at once (`reserved_workers` of them kept for the
    listener's urgent requests), a FIFO of the requests that passed their gate while every one was busy
    (an fd each, no thread), the stream thread long answers are handed to, and the connections going back
    to the selector after their answer."""

    def __init__(self, server: BoundedHTTPServer) -> None:
        self._server, self._limits = server, server.limits
        self._busy = 0  # `_lock`
        self._waiting: deque[_Conn] = deque()  # passed the gate, waiting for a worker (FIFO)
        self._waiting_urgent: deque[_Conn] = deque()
        self._returns: SimpleQueue[tuple[_Conn, bool | None]] = SimpleQueue()
        self._closed = False  # `_lock`
        self._lock = threading.Lock()
        self.pump = _StreamPump(server)

    @property
    def busy(self) -> int:
        return self._busy

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._waiting_urgent)

    def take(self, urgent: bool) -> bool:
        """A worker, if one is free for this request (an urgent one may take the reserved ones)."""
        cap = self._limits.max_workers - (0 if urgent else self._limits.reserved_workers)
        with self._lock:
            if self._busy < cap:
                self._busy += 1
                return True
            return False

    def _release(self) -> None:
        with self._lock:
            self._busy -= 1
        self._server._wake()

    def wait(self, conn: _Conn, urgent: bool) -> None:
        (self._waiting_urgent if urgent else self._waiting).append(conn)

    def start_waiting(self) -> None:
        """Workers for the waiting requests, urgent ones first, while there are free ones."""
        for waiting, urgent in ((self._waiting_urgent, True), (self._waiting, False)):
            while waiting and self.take(urgent):
                conn = waiting.popleft()
                self._server._budgets.release(conn)
                self.start(conn)

    def start(self, conn: _Conn) -> None:
        """On a worker thread; the caller took the worker and the connection is out of the selector."""
        conn.sock.setblocking(True)
        try:
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._server.name}-worker", daemon=True).start()
        except RuntimeError:  # no thread could be started
            self._release()
            conn.sock.setblocking(False)
            self._server._enter(conn)
            self._server._refuse(conn, _busy(self._limits, "no thread available"))

    def expire(self, now: float) -> None:
        """A request that waited `wait_seconds` for a worker is answered 503."""
        for waiting in (self._waiting, self._waiting_urgent):
            while waiting and waiting[0].deadline <= now:
                conn = waiting.popleft()
                conn.sock.setblocking(False)
                self._server._enter(conn)
                self._server._refuse(conn, _busy(self._limits, f"no worker was free for {self._limits.wait_seconds:g} s"))

    def _serve(self, conn: _Conn) -> None:
        server = self._server
        keep = False
        request: ServedRequest | None = None
        try:
            request = server.handler(server, conn)
            request.handle()
            if request.handed_off is not None:
                self.pump.add(conn, request, request.handed_off)
                return
            keep = request.finish()
        except (ConnectionError, TimeoutError) as exc:
            log.debug("%s: client %s went away: %s", server.name, conn.address or "unix", exc)
        except Exception:
            log.exception("%s: serving a request failed", server.name)
        finally:
            self._release()
            if request is None or request.handed_off is None:
                self.give_back(conn, keep)

    def give_back(self, conn: _Conn, keep: bool | None) -> None:
        """Back to the selector (keep: for its next request; False: to be closed after a linger; None: the
        stream thread already closed it)."""
        with self._lock:
            if self._closed:
                if keep is not None:
                    conn.sock.close()
                return
            self._returns.put((conn, keep))
        self._server._wake()

    def returned(self) -> Iterator[tuple[_Conn, bool | None]]:
        """The connections given back since the selector last looked."""
        while True:
            try:
                yield self._returns.get_nowait()
            except Empty:
                return

    def close(self) -> bool:
        """No more connections come back (a worker that ends later closes its own); the stream thread ends and
        the waiting requests are closed. False when already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self.pump.close()
        for conn in [*self._waiting, *self._waiting_urgent]:
            conn.sock.close()
        self._waiting.clear()
        self._waiting_urgent.clear()
        return True


@dataclass(eq=False)
class _Streaming:
    conn: _Conn
    request: ServedRequest
    stream: Stream
    pending: bytearray = field(default_factory=bytearray)  # framed by h11, not yet taken by the socket
    ended: bool = False
    stalled_since: float | None = None  # the client stopped taking our bytes
    unread: int = 0
    wake: Callable[[], None] = lambda: None  # what the stream calls when it has more


class _StreamPump:
    """One thread that copies every handed-off answer stream to its client without blocking on any of them.

    Each tick it asks each stream with nothing pending for what it has ready, frames it with the
    request's h11 connection, and sends what the socket takes; the rest waits for the socket to be
    writable. A client that stops reading for `write_seconds`, or closes, loses its stream; a
    finished stream gives its connection back to the selector (for its next request, or a linger).
    """

    def __init__(self, server: BoundedHTTPServer) -> None:
        self._server = server
        self._selector = selectors.DefaultSelector()
        self._streams: dict[socket.socket, _Streaming] = {}
        self._incoming: SimpleQueue[_Streaming] = SimpleQueue()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._dirty: set[_Streaming] = set()  # streams that said they have more (any thread adds)
        self._dirty_lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._streams)

    def add(self, conn: _Conn, request: ServedRequest, stream: Stream) -> None:
        conn.sock.setblocking(False)
        self._incoming.put(_Streaming(conn, request, stream))
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._server.name}-streams", daemon=True)
                self._thread.start()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        with self._start_lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        while True:
            try:
                self._incoming.get_nowait().conn.sock.close()
            except Empty:
                break
        for entry in list(self._streams.values()):
            entry.conn.sock.close()
        self._streams.clear()
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _poke(self, entry: _Streaming) -> None:
        with self._dirty_lock:
            fresh = not self._dirty
            self._dirty.add(entry)
        if fresh:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass  # a wake is already pending, or the pump is closing

    def _run(self) -> None:
        idle_since = time.monotonic()
        next_all = 0.0
        try:
            while not self._stop.is_set():
                if self._streams:
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > _PUMP_IDLE_SECONDS and self._retire():
                    return
                for key, events in self._selector.select(_PUMP_TICK_SECONDS):
                    if key.fileobj == self._wake_r:
                        self._take_incoming()
                        continue
                    entry: _Streaming = key.data
                    if events & selectors.EVENT_READ and not self._client_sent(entry):
                        continue
                    if events & selectors.EVENT_WRITE:
                        self._flush(entry)
                self._take_incoming()
                now = time.monotonic()
                with self._dirty_lock:
                    due, self._dirty = self._dirty, set()
                if now >= next_all:  # every stream once a second: heartbeats, and any wake that was missed
                    due, next_all = set(self._streams.values()), now + _PUMP_ALL_SECONDS
                for entry in due:
                    if entry.conn.sock in self._streams and not entry.pending and not entry.ended:
                        self._pull(entry)
                for entry in list(self._streams.values()):
                    if entry.pending:
                        self._flush(entry)
                    if entry.ended and not entry.pending:
                        self._finish(entry)
        except Exception:
            log.exception("%s: the stream thread failed; its streams are closed", self._server.name)
            for entry in list(self._streams.values()):
                self._drop(entry)

    def _retire(self) -> bool:
        """End the idle thread (the next stream starts another), unless a stream is just being added."""
        with self._start_lock:
            if not self._incoming.empty():
                return False
            self._thread = None
            return True

    def _take_incoming(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                entry = self._incoming.get_nowait()
            except Empty:
                return
            self._streams[entry.conn.sock] = entry
            self._selector.register(entry.conn.sock, selectors.EVENT_READ, entry)
            entry.wake = functools.partial(self._poke, entry)
            entry.stream.watch(entry.wake)
            self._pull(entry)

    def _pull(self, entry: _Streaming) -> None:
        try:
            data, ended = entry.stream.read()
        except Exception:
            log.exception("%s: an answer stream failed; its connection is closed", self._server.name)
            return self._drop(entry)
        parser = entry.request._parser
        if data:
            entry.pending += parser.send(h11.Data(data=data)) or b""
        if ended:
            entry.pending += parser.send(h11.EndOfMessage()) or b""
            entry.ended = True

    def _flush(self, entry: _Streaming) -> None:
        sock = entry.conn.sock
        if sock not in self._streams:
            return
        try:
            sent = sock.send(entry.pending)
        except BlockingIOError:
            sent = 0
        except OSError:
            return self._drop(entry)
        del entry.pending[:sent]
        now = time.monotonic()
        if not entry.pending:
            entry.stalled_since = None
            self._selector.modify(sock, selectors.EVENT_READ, entry)
            return
        if sent or entry.stalled_since is None:
            entry.stalled_since = now
            self._selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, entry)
        elif now - entry.stalled_since > self._server.limits.write_seconds or len(entry.pending) > _PUMP_MAX_PENDING:
            self._drop(entry)

    def _client_sent(self, entry: _Streaming) -> bool:
        """The client wrote while its answer streams: its end of input closes the stream; a pipelined
        request is kept (bounded) for after it. False when the stream was dropped."""
        try:
            data = entry.conn.sock.recv(_RECV)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        entry.unread += len(data)
        if not data or entry.unread > _PUMP_MAX_UNREAD:
            self._drop(entry)
            return False
        entry.request._parser.receive_data(data)
        return True

    def _finish(self, entry: _Streaming) -> None:
        self._forget(entry)
        self._server._workers.give_back(entry.conn, entry.request.finish())

    def _drop(self, entry: _Streaming) -> None:
        if entry.conn.sock not in self._streams:
            return
        self._forget(entry)
        entry.conn.sock.close()
        self._server._workers.give_back(entry.conn, None)

    def _forget(self, entry: _Streaming) -> None:
        del self._streams[entry.conn.sock]
        self._selector.unregister(entry.conn.sock)
        entry.stream.unwatch(entry.wake)


def _peer_key(sock: socket.socket, address: Any) -> str:
    """The IP of a TCP peer (its /64 for IPv6, which one host has whole); on a Unix socket the uid the kernel
    recorded at connect."""
    if isinstance(address, tuple) and address:
        try:
            ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
        except ValueError:
            return str(address[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
            return str(ipaddress.IPv6Network((ip, 64), strict=False))
        return str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip)
    try:
        data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        return f"uid {int.from_bytes(data[4:8], 'little')}"
    except OSError:
        return "unix"


def _source_allowed(address: Any, sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]) -> bool:
    """Whether a TCP peer is of the networks a listener serves (none given: every source; a Unix socket's: yes)."""
    if not sources or not isinstance(address, tuple):
        return True
    try:
        ip = ipaddress.ip_address(address[0].split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in sources)


def _send_once(sock: socket.socket, data: bytes) -> bool:
    """One non-blocking send: a short answer fits the socket buffer, and the selector must never wait."""
    try:
        return sock.send(data) == len(data)
    except OSError:
        return False


def _busy(limits: ServerLimits, why: str) -> Refusal:
    retry = str(limits.retry_after_seconds)
    return Refusal(503, f"{why}; try again in {retry} s", (("Retry-After", retry),))


def _render(refusal: Refusal, error_body: Callable[[str], bytes], head_only: bool = False) -> bytes:
    """The answer's bytes, framed by a fresh h11 connection (h11 allows an answer to a request it never
    parsed); to a HEAD request without the body (RFC 9110 9.3.2: a client reads none, so one sent would be
    taken for the next answer), as ServedRequest answers HEAD too."""
    body = error_body(refusal.message)
    framer = h11.Connection(h11.SERVER)
    head = framer.send(h11.Response(
        status_code=refusal.status, reason=HTTPStatus(refusal.status).phrase.encode(),
        headers=[("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Connection", "close"),
                 *refusal.headers]))
    return head if head_only else head + framer.send(h11.Data(data=body)) + framer.send(h11.EndOfMessage())


_HUGE_LENGTH = re.compile(rb"(?im)^content-length:[ \t]*[0-9]{19,}[ \t]*\r?$")


def _malformed(exc: h11.RemoteProtocolError, limits: ServerLimits, last: bytes = b"") -> Refusal:
    """h11's verdict on bytes that are not an HTTP/1.1 request, in words a client can act on."""
    if exc.error_status_hint == 431:
        return Refusal(431, f"the request head is larger than {limits.max_head_bytes} bytes")
    if exc.error_status_hint == 501:
        return Refusal(501, "only Transfer-Encoding: chunked is supported")
    if str(exc) == "bad Content-Length" and _HUGE_LENGTH.search(last):
        return Refusal(413, "the declared Content-Length is larger than any body this server takes")
    return Refusal(400, f"malformed request: {_describe(exc)}")


def _describe(exc: h11.RemoteProtocolError) -> str:
    """h11's words without the bytes it quotes ("Illegal header value b'...'"): a stranger's header, NULs
    and all, is not echoed back."""
    return re.split(r":? (?:b['\"]|bytearray\()", str(exc), maxsplit=1)[0][:_MAX_ERROR_TEXT]


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)
