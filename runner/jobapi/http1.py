"""The job client's HTTP/1.1 connections: the standard library's http.client, over a Unix socket or TCP.

`JobClient` needs little of HTTP: one request at a time per connection, bodies streamed both ways (a
checkout sent chunked from an iterator, log lines read as they arrive), one timeout for connecting, each
read and each write, and at most one connection kept between requests. http.client does all of that; httpx,
which did it before, cost ~50 ms of every `run`'s start (its import, httpcore's and h11's: most of the
client's share of a `run -- true` through `serve`, issue 26), for features the job API never uses.

What this module adds to http.client is what a pool adds: a bound on connections open at once (callers may
follow several jobs' logs from threads), the kept connection, dropped instead of reused once it is past its
expiry or the service has closed it (a readable idle socket: the end of the stream, or bytes nobody asked
for), and failures as three exception types: `ConnectError` (nothing was sent), `Timeout`, `TransportError`.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from email.message import Message
from urllib.parse import SplitResult

from runner.errors import ClientError


class TransportError(ClientError):
    """The request could not be sent or its answer read: the connection failed or the answer broke off.
    (JobClient says which request and where; its JobAPIError is what leaves the client.)"""


class ConnectError(TransportError):
    """No connection could be made: nothing of the request was sent."""


class Timeout(TransportError):
    """The service did not accept, read or answer within the timeout (or no connection came free)."""


Body = bytes | Iterable[bytes] | None


class _UnixConnection(http.client.HTTPConnection):
    """HTTP on a Unix socket: `Host: localhost`, as the service expects of a local client."""

    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class Response:
    """A streamed answer: read it with `iter_bytes`, then `close` it (which gives the connection back)."""

    def __init__(self, raw: http.client.HTTPResponse, connection: http.client.HTTPConnection, pool: Pool) -> None:
        self._raw, self._connection, self._pool = raw, connection, pool
        self.status_code = raw.status
        self.reason_phrase = raw.reason
        self.headers: Message = raw.headers
        self._closed = False

    def iter_bytes(self, size: int | None = None) -> Iterator[bytes]:
        """The body's bytes as they arrive, at most `size` at a time (default 64 KiB)."""
        while True:
            try:
                chunk = self._raw.read1(size or 65536)
                if not chunk:
                    # the end: a Content-Length answer read to its length is marked done (reusable) only
                    # by a read() (read1 of 0 bytes does not), which reads nothing more
                    self._raw.read()
                    return
            except TimeoutError as exc:
                raise Timeout("timed out reading the answer") from exc
            except (OSError, http.client.HTTPException) as exc:
                raise TransportError(_reason(exc)) from exc
            yield chunk

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        reusable = self._raw.isclosed() and not self._raw.will_close  # read to its end, and the service keeps it
        self._raw.close()
        self._pool.give_back(self._connection, reusable)


class Pool:
    """Connections to one service (`where`: a Unix socket path, or an http(s) URL split), at most
    `max_connections` open at once, up to `keep` of them kept for `expiry` seconds after their answer."""

    def __init__(self, where: str | SplitResult, timeout: float | None, max_connections: int = 16,
                 keep: int = 0, expiry: float = 4.0) -> None:
        self._where = where
        self._timeout = timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._keep, self._expiry = keep, expiry
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []  # (connection, monotonic expiry)
        self._lock = threading.Lock()
        self.prefix = where.path.rstrip("/") if isinstance(where, SplitResult) else ""

    def send(self, method: str, path: str, headers: Mapping[str, str], body: Body = None) -> Response:
        """The answer's status and headers, its body still to read. A body iterator's own exception (a
        checkout that cannot be packed) comes out as it is, the connection closed."""
        if not self._slots.acquire(timeout=-1 if self._timeout is None else self._timeout):
            raise Timeout("no connection came free within the timeout")
        try:
            connection = self._take() or self._connect()
            raw = self._exchange(connection, method, self.prefix + path, headers, body)
        except BaseException:
            self._slots.release()
            raise
        return Response(raw, connection, self)

    def give_back(self, connection: http.client.HTTPConnection, reusable: bool) -> None:
        with self._lock:
            kept = reusable and len(self._idle) < self._keep
            if kept:
                self._idle.append((connection, time.monotonic() + self._expiry))
        if not kept:
            connection.close()
        self._slots.release()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection, _ in idle:
            connection.close()

    def _take(self) -> http.client.HTTPConnection | None:
        """A kept connection still good to send on; the expired and those the service closed are dropped."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection, expires = self._idle.pop()
            sock = connection.sock
            if sock is not None and time.monotonic() < expires and not select.select([sock], [], [], 0)[0]:
                return connection
            connection.close()

    def _connect(self) -> http.client.HTTPConnection:
        where = self._where
        connection: http.client.HTTPConnection
        if isinstance(where, str):
            connection = _UnixConnection(where, self._timeout)
        elif where.scheme == "https":
            connection = http.client.HTTPSConnection(where.hostname or "", where.port, timeout=self._timeout)
        else:
            connection = http.client.HTTPConnection(where.hostname or "", where.port, timeout=self._timeout)
        try:
            connection.connect()
        except TimeoutError as exc:
            connection.close()
            raise Timeout("timed out connecting") from exc
        except OSError as exc:
            connection.close()
            raise ConnectError(_reason(exc)) from exc
        return connection

    @staticmethod
    def _exchange(connection: http.client.HTTPConnection, method: str, path: str, headers: Mapping[str, str],
                  body: Body) -> http.client.HTTPResponse:
        """Send the request and read the answer's head. A service may answer before it has read the whole
        body (a refusal) and close: the answer is read even when sending the rest failed."""
        try:
            try:
                connection.request(method, path, body=body, headers=dict(headers))
            except TimeoutError:
                raise
            except OSError as sending:
                try:
                    return connection.getresponse()
                except (OSError, http.client.HTTPException):
                    raise sending from None
            return connection.getresponse()
        except TimeoutError as exc:
            connection.close()
            raise Timeout("timed out") from exc
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise TransportError(_reason(exc)) from exc
        except BaseException:
            connection.close()
            raise


def _reason(exc: BaseException) -> str:
    """The error's own words, or its class name when it has none."""
    return str(exc) or type(exc).__name__
