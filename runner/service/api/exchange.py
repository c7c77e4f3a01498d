"""What a route may use of one request on the job API: the `Exchange` (its head, who asks, its body, its
answer) and the `Listener` it came in on.

Routes are written against these two types, never against the Handler: runner/service/api/handler.py's
Handler is the one Exchange, and no route imports it (so no route can reach the HTTP machinery behind
it). A route raises the service's errors for a refusal; the Handler turns them into their statuses
(runner.service.api.refusals.STATUS).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Mapping
from http.client import HTTPMessage
from typing import TYPE_CHECKING, Protocol

from runner.httpserve import BoundedHTTPServer

if TYPE_CHECKING:
    from runner.httpserve import Stream
    from runner.service.api.metrics import JobMetrics
    from runner.service.github.desk import RunnerDesk
    from runner.service.jobs.auth import Caller
    from runner.service.jobs.sandboxes import SandboxDesk
    from runner.service.jobs.service import JobService


def _no_host_status() -> dict[str, object]:
    return {}


class Listener(BoundedHTTPServer):
    """A listener of the job API (runner/service/api/listeners.py's servers), and what the host gave it to
    answer with; set by ApiServers."""

    kind = "unix"  # or "tcp": the path table's name for it, and its requests' label in the metrics
    service: JobService
    token: str | None = None  # the TCP listener's bearer token (it also keys the page's CSRF tokens)
    host_status: Callable[[], dict[str, object]] = staticmethod(_no_host_status)  # GET /v1/status
    desk: RunnerDesk | None = None  # the runners' job hooks; None in a server built without the runner desk
    metrics: JobMetrics | None = None  # the requests it answers are counted there
    sandboxes: SandboxDesk | None = None  # None when the service runs no VM engine of its own (404)


class Exchange(Protocol):
    """One request and its answer, as a route sees it.

    The answer is `respond` (whole), `send_json`, or a stream: `start_response`, `send_data`...
    `end_response`, or `hand_off` to the listener's stream thread; `upgrade` gives the connection to a
    terminal session (attach.py) once the route decided to take it."""

    path: str  # the request target as logged (the page drops a ?token= from it before the log sees it)
    headers: HTTPMessage  # case-insensitive; get() gives the first value
    close_connection: bool  # a route that leaves a body unread sets it: the connection cannot be reused

    @property
    def method(self) -> str: ...

    @property
    def query(self) -> dict[str, list[str]]: ...

    @property
    def listener(self) -> Listener: ...

    @property
    def service(self) -> JobService: ...

    def caller(self) -> Caller:
        """Who sent this request (runner/service/jobs/auth.py); Unauthorized for a runner token not issued."""

    def peer(self) -> socket.socket | None:
        """The Unix peer's socket, whose credentials the kernel keeps (group checks); None on TCP."""

    def body(self) -> Iterator[bytes]:
        """The request body piece by piece; BodyFramingError when its framing is broken."""

    def json_body(self) -> object:
        """The body as JSON, unchecked (the service's parsers check its shape); TooLarge, BadRequest."""

    def respond(self, status: int, body: bytes, headers: Mapping[str, str]) -> None: ...

    def send_json(self, status: int, obj: object, headers: Mapping[str, str] | None = None) -> None: ...

    def start_response(self, status: int, headers: Mapping[str, str]) -> None: ...

    def send_data(self, data: bytes) -> None: ...

    def end_response(self) -> None: ...

    def hand_off(self, stream: Stream) -> None: ...

    def upgrade(self, protocol: str) -> tuple[socket.socket, bytes]:
        """Answer 101 for `protocol`: the raw socket, and what the client sent after its head."""
