"""One request on the job API: its body read within its limits, its answer, a refusal turned into its
status (runner.service.api.refusals.STATUS), and the request counted in the metrics once it has ended.

The Handler is the routes' Exchange (runner/service/api/exchange.py); which route answers it is the path
table's (runner/service/api/paths.py)."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

import h11

from runner import jsonbody
from runner.errors import JobError
from runner.httpserve import BadRequestBody, ServedRequest
from runner.jobapi.contract import MAX_JSON_BODY, RUNNER_TOKEN_HEADER, QueueFullAnswer
from runner.service.api import paths
from runner.service.api.exchange import Listener
from runner.service.api.metrics import route_of
from runner.service.api.refusals import BadRequest, BodyFramingError, NoRoute, status_of
from runner.service.jobs.admission import TooLarge
from runner.service.jobs.auth import Caller
from runner.service.jobs.jobqueue import QueueFull

if TYPE_CHECKING:
    from runner.service.jobs.service import JobService

log = logging.getLogger(__name__)


class Handler(ServedRequest):
    server: Listener

    # -- the request, as a route sees it (exchange.Exchange) ----------------------------------------

    @property
    def method(self) -> str:
        return self.command

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.path).query)

    @property
    def listener(self) -> Listener:
        return self.server

    @property
    def service(self) -> JobService:
        return self.server.service

    def caller(self) -> Caller:
        """Who sent this request (runner/service/jobs/auth.py): the Unix peer's uid or the TCP gate, and a
        runner token when one was sent."""
        runner_token = self.headers.get(RUNNER_TOKEN_HEADER)
        if self.server.kind == paths.UNIX:
            return self.service.access.unix_caller(self._sock, runner_token)
        return self.service.access.tcp_caller(runner_token)

    def peer(self) -> socket.socket | None:
        return self._sock if self.server.kind == paths.UNIX else None

    def body(self) -> Iterator[bytes]:
        """ServedRequest.body, its broken framing a refusal of the API's (BodyFramingError)."""
        try:
            yield from super().body()
        except BadRequestBody as exc:
            raise BodyFramingError(str(exc)) from None

    def json_body(self) -> object:
        """The body as JSON, still unchecked: the service's parsers check its shape."""
        data = bytearray()
        for chunk in self.body():
            data += chunk
            if len(data) > MAX_JSON_BODY:
                self.close_connection = True
                raise TooLarge(f"the request body is larger than {MAX_JSON_BODY} bytes")
        try:
            return jsonbody.loads(bytes(data) or b"null", max_containers=jsonbody.MAX_CONTAINERS)
        except jsonbody.JsonBodyError as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from exc

    def send_json(self, status: int, obj: object, headers: Mapping[str, str] | None = None) -> None:
        self.respond(status, json.dumps(obj).encode() + b"\n", {"Content-Type": "application/json", **(headers or {})})

    def respond(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self._answered = status
        super().respond(status, body, headers)

    def start_response(self, status: int, headers: Mapping[str, str]) -> None:
        self._answered = status
        super().start_response(status, headers)

    def upgrade(self, protocol: str) -> tuple[socket.socket, bytes]:
        """101 to `protocol`; the connection is the caller's from here (never reused for HTTP)."""
        self._answered = 101
        self._send(h11.InformationalResponse(status_code=101, headers=[("Upgrade", protocol),
                                                                      ("Connection", "Upgrade")]))
        self.close_connection = True
        return self._sock, self._parser.trailing_data[0]

    # -- answering ----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Answer the route, counted in the metrics by route and status (once it has ended)."""
        started = time.monotonic()
        self._answered = 0  # 0: no answer went out (the client left first)
        try:
            self._answer()
        finally:
            metrics = self.server.metrics
            if metrics is not None:
                metrics.request(self.server.kind, route_of(urlsplit(self.path).path), self.method, self._answered,
                                time.monotonic() - started)

    def _route(self) -> None:
        """The path table's route answers, or there is none (404)."""
        path = urlsplit(self.path).path
        found = paths.find(self.method, path, self.server.kind)
        if found is None:
            raise NoRoute(f"no route {self.method} {path}; see docs/job-api.md")
        found.route.answer(self, found.params)

    def _answer(self) -> None:
        """Answer the route; errors become statuses. A client gone away propagates to the server (logged at debug)."""
        expects_body = self.method in ("POST", "PUT")
        try:
            self._route()
        except JobError as exc:
            # the body may be unread (or, for framing, unreadable): the connection cannot be reused
            if expects_body or isinstance(exc, (QueueFull, BodyFramingError)):
                self.close_connection = True
            if isinstance(exc, QueueFull):
                return self._queue_full(exc)
            message = f"bad request: {exc}" if isinstance(exc, BodyFramingError) else str(exc)
            retry_after = getattr(exc, "retry_after", None)  # a refusal that says when to come back
            self._error(status_of(exc), message, {"Retry-After": str(retry_after)} if retry_after else None)
        except UnicodeError as exc:  # e.g. a lone surrogate that reached a field
            self.close_connection = True
            self._error(400, f"bad request: text that is not valid Unicode ({getattr(exc, 'reason', exc)})")
        except (ConnectionError, TimeoutError):
            raise
        except Exception:
            log.exception("api: %s %s failed", self.method, self.path)
            self.close_connection = True
            self._error(500, "internal error in the job service; see its log")

    def _error(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        self.send_json(status, {"error": message}, headers)

    def _queue_full(self, exc: QueueFull) -> None:
        """429 with Retry-After, and how many jobs wait ahead, so the action can say what it waits behind."""
        queued = sum(self.service.queue.counts())
        self.send_json(status_of(exc), QueueFullAnswer(str(exc), queued).to_wire(),
                       {"Retry-After": str(exc.retry_after)})

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()
