"""What the listener fuzz targets share: one raw exchange over a real socket, the answers parsed strictly,
the contract every answer must keep, and the settle check for threads and file descriptors.

The client half-closes after sending, so a request the server still waits on (a head without its blank
line, a body shorter than its Content-Length, a chunked body without its last chunk) ends at once
instead of after the server's deadlines: the fuzz stays fast, and the server sees a client going away,
which is one of the inputs it must survive. A job's live log is a stream that only ends with the job,
so the exchange stops at the head of such an answer.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

EXCHANGE_SECONDS = 10.0  # no answer within this is a failure: the client half-closed, nothing is pending
# The head of a log stream, whatever framing follows (chunked; close-delimited to HTTP/1.0) and whether it
# ends with Connection: close.
STREAM_HEAD = re.compile(rb"\r\nContent-Type: application/x-ndjson\r\n(?:[^\r\n]+\r\n)*\r\n")


@dataclass
class Answer:
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes
    stream: bool = False  # a log stream cut after its head


@dataclass
class Exchange:
    raw: bytes
    answers: list[Answer]
    reset: bool  # the server reset the connection (it refused early and we were still sending)


class _Unclosed(io.BytesIO):
    """http.client closes its file after an answer with `Connection: close`; what follows is still checked."""

    def close(self) -> None:
        pass


class _Recorded:
    """http.client reads a response from `sock.makefile()`: give it what the server sent, in order."""

    def __init__(self, data: bytes) -> None:
        self.file = _Unclosed(data)

    def makefile(self, mode: str) -> io.BytesIO:
        return self.file


def exchange(connect: Callable[[], socket.socket], data: bytes) -> Exchange:
    """Send `data` on a new connection, half-close, and read every answer until the server closes."""
    received = bytearray()
    reset = False
    with connect() as sock:
        sock.settimeout(EXCHANGE_SECONDS)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            reset = True  # refused before the whole request was sent: what it answered is still readable
        deadline = time.monotonic() + EXCHANGE_SECONDS
        while not STREAM_HEAD.search(received):
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                reset = True
                break
            except TimeoutError:
                raise AssertionError(f"no end of the answer within {EXCHANGE_SECONDS} s; got {bytes(received[:300])!r}"
                                     f" for {data[:300]!r}") from None
            if not chunk:
                break
            received += chunk
    first_method = data.split(b" ", 1)[0].decode("latin-1")
    return Exchange(bytes(received), parse_answers(bytes(received), first_method), reset)


def parse_answers(data: bytes, first_method: str = "GET") -> list[Answer]:
    """Every answer in `data`, each of which must be well-formed HTTP/1.1; a log stream only to its head.

    The answer to a HEAD request has headers only: http.client needs the method to know that.
    """
    recorded = _Recorded(data)
    answers: list[Answer] = []
    while recorded.file.tell() < len(data):
        method = first_method if not answers else "GET"
        response = http.client.HTTPResponse(recorded, method=method)  # type: ignore[arg-type]
        response.begin()
        headers = {name.lower(): value for name, value in response.getheaders()}
        if headers.get("content-type") == "application/x-ndjson":
            answers.append(Answer(response.status, response.reason, headers, b"", stream=True))
            break
        answers.append(Answer(response.status, response.reason, headers, response.read()))
    return answers


# RFC 9110 15.6.2 / RFC 9112 6.1: 501 is the answer for a method or a transfer coding the server does not
# implement, a statement about the request, not a failure of the server. Allowed for exactly those causes
# (HEAD is one such method here; its answers carry no body that could name the cause).
NOT_IMPLEMENTED = (b"Unsupported method", b"only Transfer-Encoding: chunked is supported")


def check_answers(result: Exchange, request: bytes) -> None:
    """The contract for every input: no 5xx but a 503 that says when to come back (and the 501s above)."""
    for answer in result.answers:
        if answer.status == 503 and answer.headers.get("retry-after", "").isdigit():
            continue
        if answer.status == 501 and (any(cause in answer.body or cause.decode() in answer.reason
                                         for cause in NOT_IMPLEMENTED) or request.startswith(b"HEAD ")):
            continue
        if answer.status >= 500:
            raise AssertionError(f"{answer.status} {answer.body[:300]!r} for {request[:400]!r}")


class Tracebacks(logging.Handler):
    """Every WARNING+ record of the service's loggers that carries a traceback, and threads that died."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []
        self.died: list[str] = []
        self._hook = threading.excepthook

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record)
        if record.exc_info or "Traceback" in text:
            self.records.append(text)

    def __enter__(self) -> Tracebacks:
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        logging.getLogger("runner").addHandler(self)
        threading.excepthook = lambda args: self.died.append(f"{args.thread}: {args.exc_value!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("runner").removeHandler(self)
        threading.excepthook = self._hook

    def check(self, request: bytes) -> None:
        assert not self.died, f"a thread died after {request[:400]!r}: {self.died[0]}"
        assert not self.records, f"a traceback was logged after {request[:400]!r}:\n{self.records[0]}"


@dataclass
class Usage:
    fds: list[str] = field(default_factory=list)
    threads: list[str] = field(default_factory=list)

    @classmethod
    def now(cls) -> Usage:
        fds = []
        for name in os.listdir("/proc/self/fd"):
            try:
                fds.append(os.readlink(f"/proc/self/fd/{name}"))
            except OSError:
                continue  # the listdir's own fd, already closed
        return cls(sorted(fds), sorted(t.name for t in threading.enumerate()))


def settle(baseline: Usage, seconds: float = 15.0) -> Usage:
    """Poll until the process holds no more fds or threads than at `baseline`; the last usage seen."""
    deadline = time.monotonic() + seconds
    while True:
        usage = Usage.now()
        if (len(usage.fds) <= len(baseline.fds) and len(usage.threads) <= len(baseline.threads)) \
                or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


def assert_settled(baseline: Usage, after: Usage) -> None:
    def extra(now: list[str], before: list[str]) -> list[str]:
        return list((Counter(now) - Counter(before)).elements())[:20]

    assert len(after.fds) <= len(baseline.fds), f"fds not released: {extra(after.fds, baseline.fds)}"
    assert len(after.threads) <= len(baseline.threads), f"threads left: {extra(after.threads, baseline.threads)}"
