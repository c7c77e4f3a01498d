"""One request on the job API: its body read within its limits, its answer, a refusal turned into its
status (runner.service.api.refusals.STATUS), and the request counted in the metrics once it has ended. Which
route answers it is runner/service/api/routes.py's."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from runner import jsonbody
from runner.errors import JobError
from runner.httpserve import BadRequestBody, ServedRequest
from runner.jobapi.contract import MAX_JSON_BODY, RUNNER_TOKEN_HEADER, Health, QueueFullAnswer
from runner.service.api.metrics import route_of
from runner.service.api.refusals import BadRequest, BodyFramingError, status_of
from runner.service.api.routes import route
from runner.service.jobs.admission import TooLarge
from runner.service.jobs.auth import Caller, Unauthorized
from runner.service.jobs.jobqueue import QueueFull

if TYPE_CHECKING:
    from runner.service.api.listeners import TcpApiServer, UnixApiServer
    from runner.service.jobs.service import JobService

log = logging.getLogger(__name__)


class Handler(ServedRequest):
    server: UnixApiServer | TcpApiServer

    # -- plumbing -----------------------------------------------------------------------------

    @property
    def service(self) -> JobService:
        return self.server.service

    def _body(self) -> Iterator[bytes]:
        try:
            yield from self.body()
        except BadRequestBody as exc:
            raise BodyFramingError(str(exc)) from None

    def _json_body(self) -> object:
        """The body as JSON, still unchecked: the service's parsers check its shape."""
        data = bytearray()
        for chunk in self._body():
            data += chunk
            if len(data) > MAX_JSON_BODY:
                self.close_connection = True
                raise TooLarge(f"the request body is larger than {MAX_JSON_BODY} bytes")
        try:
            return jsonbody.loads(bytes(data) or b"null", max_containers=jsonbody.MAX_CONTAINERS)
        except jsonbody.JsonBodyError as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from exc

    def _send_json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
        self.respond(status, json.dumps(obj).encode() + b"\n", {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._send_json(status, {"error": message}, headers)

    def respond(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self._answered = status
        super().respond(status, body, headers)

    def start_response(self, status: int, headers: Mapping[str, str]) -> None:
        self._answered = status
        super().start_response(status, headers)

    def _dispatch(self, method: str) -> None:
        """Answer the route, counted in the metrics by route and status (once it has ended)."""
        started = time.monotonic()
        self._answered = 0  # 0: no answer went out (the client left first)
        try:
            self._answer(method)
        finally:
            metrics = self.server.metrics
            if metrics is not None:
                metrics.request(self.server.kind, route_of(urlsplit(self.path).path), method, self._answered,
                                time.monotonic() - started)

    def _answer(self, method: str) -> None:
        """Answer the route; errors become statuses. A client gone away propagates to the server (logged at debug)."""
        expects_body = method in ("POST", "PUT")
        try:
            route(self, method)
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
            log.exception("api: %s %s failed", method, self.path)
            self.close_connection = True
            self._error(500, "internal error in the job service; see its log")

    def _queue_full(self, exc: QueueFull) -> None:
        """429 with Retry-After, and how many jobs wait ahead, so the action can say what it waits behind."""
        queued = sum(self.service.queue.counts())
        self._send_json(status_of(exc), QueueFullAnswer(str(exc), queued).to_wire(),
                        {"Retry-After": str(exc.retry_after)})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # -- who asks ---------------------------------------------------------------------------------

    def _caller(self) -> Caller:
        """Who sent this request (runner/service/jobs/auth.py): the Unix peer's uid or the TCP gate, and a
        runner token when one was sent."""
        runner_token = self.headers.get(RUNNER_TOKEN_HEADER)
        if self.server.kind == "unix":
            return self.service.access.unix_caller(self._sock, runner_token)
        return self.service.access.tcp_caller(runner_token)

    def _health(self) -> Health:
        """The counts are the whole host's activity, every repository's: the operator's to see, not a
        socket member's or a runner's (they get whether the service is up, and its accelerator)."""
        health = self.service.health()
        try:
            operator = self._caller().operator
        except Unauthorized:
            operator = False
        return health if operator else health.without_counts()
