"""The job API over HTTP/1.1: a Unix socket (group-restricted) and, when configured, TCP with a token.

Served by `runner.httpserve` (h11 parses and frames the HTTP/1.1): heads are read by one selector
thread under overall deadlines, the TCP token is checked right after the headers (before any body is
read or a worker is taken), and at most MAX_WORKERS requests are served at once. Bodies are streamed
both ways: a checkout goes straight from the socket to the job's spool file, logs are a chunked NDJSON
stream copied from the job's log file, artifacts are copied from disk in chunks. See docs/job-api.md
for the routes.
"""

from __future__ import annotations

import grp
import hmac
import json
import logging
import os
import re
import socket
import stat
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import parse_qs, urlsplit

from runner import jsonbody
from runner.httpserve import (BadRequestBody, BoundedHTTPServer, Head, Limits, Refusal, ServedRequest, listen_tcp,
                              parse_decimal)
from runner.jobapi.contract import (JOB_TOKEN_HEADER, LIST_DEFAULT, LIST_MAX, MAX_JSON_BODY, MAX_LOG_SEQ,
                                    RUNNER_TOKEN_HEADER, SESSION_TOKEN_HEADER, Health, JobStarted, JobSummary,
                                    QueueFullAnswer, WireError)
from runner.service.auth import Access, Caller, Forbidden, Unauthorized
from runner.errors import ConfigError, JobError
from runner.service.egress import EgressPolicyError, PolicySourceUnavailable
from runner.service import metrics, web
from runner.service.jobqueue import QueueClosed, QueueFull
from runner.service import sandboxapi
from runner.service.sandboxes import SandboxCallError, SandboxDesk, SandboxLimit, SandboxNotFound, SandboxRefused
from runner.service.metrics import JobMetrics, route_of
from runner.service.job import SessionGone
from runner.service.joblog import LogCursor
from runner.service.sessions import SessionConflict
from runner.service.admission import InvalidJob, TooLarge
from runner.service.service import JobNotFound, JobService, JobStateConflict
from runner.service.spec import SpecError

if TYPE_CHECKING:
    from runner.service.desk import RunnerDesk

log = logging.getLogger(__name__)
T = TypeVar("T")

# Checkouts are large: after 30 s of grace a body must keep up 64 KiB/s on average. JSON bodies are read
# by the connection loop (a slow one holds no worker); 8 workers are kept for the fleet's hooks, so a job
# can always be reported and refused or admitted. `limits_for` adds connections for a large queue.
LIMITS = Limits(max_connections=512, max_workers=64, body_seconds=30.0, body_min_rate=64 * 1024,
                buffer_body_max=MAX_JSON_BODY, reserved_workers=8, max_per_peer=256)
HOOK_PATHS = frozenset({"/v1/runner/job-started", "/v1/runner/job-completed"})
_CHUNK = 1024 * 1024
HEARTBEAT_SECONDS = 15.0  # an empty line on a silent log stream (docs/job-api.md)
# Used with fullmatch: `$` also matches before a trailing newline, so "/v1/jobs/<id>\n" would be routed
# (and the id may hold no whitespace, so the newline cannot become part of it either).
_ROUTE = re.compile(r"/v1/jobs/(?P<id>[^/\s]+)(?P<rest>/checkout|/logs|/artifacts|/attestation|/cancel)?")


class BodyFramingError(JobError):
    """A request body that is not valid HTTP framing."""


class BadRequest(JobError):
    """A request this edge cannot read: a query parameter, a JSON body."""


class NoRoute(JobError):
    """No route for the path."""


class MethodNotAllowed(JobError):
    """A route that does not take this method."""


# The one place a domain error becomes an HTTP status. The service raises errors that say what went
# wrong (runner.errors.JobError and its subclasses) and knows nothing of HTTP; every JobError subclass
# has its own entry here (tests/service/test_api_errors.py walks the tree), looked up along the MRO.
# Anything else that reaches a route is a bug: 500, with its traceback in the service's log.
STATUS: dict[type[JobError], int] = {
    JobError: 400,
    BadRequest: 400,
    BodyFramingError: 400,
    BadRequestBody: 400,
    InvalidJob: 400,
    SpecError: 400,
    EgressPolicyError: 400,
    PolicySourceUnavailable: 503,  # GitHub is down: with Retry-After, so clients wait it out
    jsonbody.JsonBodyError: 400,
    Unauthorized: 401,
    Forbidden: 403,
    JobNotFound: 404,
    NoRoute: 404,
    MethodNotAllowed: 405,
    JobStateConflict: 409,
    SessionConflict: 409,
    SessionGone: 410,
    TooLarge: 413,
    QueueFull: 429,
    QueueClosed: 503,
    SandboxCallError: 400,
    SandboxRefused: 403,
    SandboxNotFound: 404,
    SandboxLimit: 429,
}


def status_of(exc: JobError) -> int:
    """The HTTP status for a refusal: its class's entry, else its nearest base's."""
    return next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)


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
            return jsonbody.loads(bytes(data) or b"null")
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
                listener = "unix" if isinstance(self.server, UnixApiServer) else "tcp"
                metrics.request(listener, route_of(urlsplit(self.path).path), method, self._answered,
                                time.monotonic() - started)

    def _answer(self, method: str) -> None:
        """Answer the route; errors become statuses. A client gone away propagates to the server (logged at debug)."""
        expects_body = method in ("POST", "PUT")
        try:
            self._route(method)
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

    # -- routes -----------------------------------------------------------------------------

    def _caller(self) -> Caller:
        """Who sent this request (runner/service/auth.py): the Unix peer's uid or the TCP gate, and a
        runner token when one was sent."""
        runner_token = self.headers.get(RUNNER_TOKEN_HEADER)
        if isinstance(self.server, UnixApiServer):
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

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if isinstance(self.server, TcpApiServer) and is_web_path(url.path):
            return self._web(method, url.path, query)
        if url.path == "/v1/health" and method == "GET":
            return self._send_json(200, self._health().to_wire())
        if url.path == "/v1/attestation-key" and method == "GET":  # public: what verifiers check records with
            return self.respond(200, self.service.attestation_key().encode(), {"Content-Type": "application/x-pem-file"})
        access, caller = self.service.access, self._caller()
        if sandboxapi.route(url.path) is not None:
            if self.server.sandboxes is None:
                raise NoRoute("this service offers no interactive sandboxes (it runs no VM engine of its own)")
            sock = self._sock if isinstance(self.server, UnixApiServer) else None
            return sandboxapi.SandboxRoutes(self, self.server.sandboxes).answer(method, url.path, query, caller, sock)
        if url.path == "/v1/jobs":
            if method == "POST":
                record, token, session_token = self.service.submit_as(caller, self._json_body(),
                                                                      self.headers.get(SESSION_TOKEN_HEADER))
                return self._send_json(201, JobSummary(record.id, record.state, token, session_token).to_wire())
            if method == "GET":
                access.require_operator(caller, "listing all jobs")
                limit = _int_param(query, "limit", LIST_DEFAULT, 1, LIST_MAX)
                return self._send_json(200, {"jobs": [r.to_wire() for r in self.service.list(limit)]})
        if url.path == "/v1/status" and method == "GET":
            access.require_operator(caller, "the host's status")
            return self._send_json(200, self.server.host_status())
        if url.path in ("/v1/runner/job-started", "/v1/runner/job-completed"):
            if method != "POST":
                raise MethodNotAllowed(f"{method} is not allowed on {url.path}")
            runner, desk = access.require_runner(caller), self.server.desk
            if desk is None:  # a server built without the host's runner desk (tests of the API alone)
                raise Forbidden("this server takes no runner reports")
            if url.path.endswith("started"):
                started = _wire(JobStarted.from_wire, self._json_body())
                return self._send_json(200, desk.runner_job_started(runner, started).to_wire())
            return self._send_json(200, {"cancelled": desk.runner_job_completed(runner)})
        route = job_route(url.path)
        if route is None:
            raise NoRoute(f"no route {method} {url.path}; see docs/job-api.md")
        job_id, rest = route
        handler = {
            ("GET", ""): lambda: self._send_json(200, self.service.get(job_id).to_wire()),
            ("PUT", "/checkout"): lambda: self._checkout(job_id, follow=_int_param(query, "follow", 0, 0, 1) == 1),
            ("GET", "/logs"): lambda: self._logs(job_id, _int_param(query, "after", 0, 0, MAX_LOG_SEQ),
                                                 follow=_int_param(query, "follow", 1, 0, 1) == 1),
            ("GET", "/artifacts"): lambda: self._artifacts(job_id),
            ("GET", "/attestation"): lambda: self.respond(200, self.service.attestation(job_id),
                                                          {"Content-Type": "application/vnd.in-toto+json"}),
            ("POST", "/cancel"): lambda: self._send_json(202, self.service.cancel(job_id).to_wire()),
        }.get((method, rest))
        if handler is None:
            raise MethodNotAllowed(f"{method} is not allowed on {url.path}")
        access.require_job(caller, job_id, self.headers.get(JOB_TOKEN_HEADER))
        handler()

    def _checkout(self, job_id: str, follow: bool = False) -> None:
        """202 and the job's summary; with `follow=1` the job's log stream instead, as GET .../logs answers it:
        a client that uploads and then follows (run, the action) needs no request of its own for the stream."""
        record = self.service.put_checkout(job_id, self._body())
        if follow:
            return self._logs(job_id, 0)
        self._send_json(202, JobSummary(record.id, record.state).to_wire())

    def _logs(self, job_id: str, after: int, follow: bool = True) -> None:
        """The log from seq `after` on, live until the job ends (`follow=0`: what is written so far)."""
        # chunked (close-delimited to HTTP/1.0), copied by the listener's stream thread: a client following
        # a queued job's log holds no worker
        stream = LogStream(self.service.log_of(job_id).cursor(after, wait=follow), lambda: self._end_line(job_id))
        self.start_response(200, {"Content-Type": "application/x-ndjson"})
        self.hand_off(stream)

    def _end_line(self, job_id: str) -> bytes:
        return json.dumps({"end": True, "job": self.service.get(job_id).to_wire()}).encode() + b"\n"

    def _artifacts(self, job_id: str, headers: dict[str, str] | None = None) -> None:
        path = self.service.artifacts_path(job_id)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.start_response(200, {"Content-Type": "application/x-tar", "Content-Length": str(size),
                                      **(headers or {})})
            left = size
            while left:
                data = f.read(min(left, _CHUNK))
                if not data:
                    raise OSError(f"{path} shrank while being sent")
                self.send_data(data)
                left -= len(data)
            self.end_response()


    # -- the metrics and the read-only web page (TCP listener only; runner/service/web.py) ----------------

    def _web(self, method: str, path: str, query: dict[str, list[str]]) -> None:
        assert isinstance(self.server, TcpApiServer)  # _route sends only the TCP listener's requests here
        ui = web.ui_job_route(path)
        if method == "POST" and ui is not None and ui[1] == "/cancel":
            return self._web_cancel(ui[0])
        if method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{method} is not allowed on {path}: only a job's cancel button posts")
        if path == "/metrics":
            return self.respond(200, self.server.metrics.exposition(), {"Content-Type": metrics.CONTENT_TYPE})
        token = query.get("token")
        if token:  # the gate checked it: trade it for a cookie, and drop it from the address (and our log)
            self.path = web.without_token(path, query)
            return self.respond(303, b"", {"Location": self.path, "Set-Cookie": web.set_cookie(token[-1]),
                                           **web.HEADERS})
        if path.startswith(web.STATIC):
            return self._web_static(path[len(web.STATIC):])
        if ui is not None:
            job_id, rest = ui
            if rest == "/logs":
                return self._web_logs(job_id, _int_param(query, "after", 0, 0, MAX_LOG_SEQ))
            if rest == "/artifacts":
                return self._artifacts(job_id, {"Content-Disposition": f'attachment; filename="{job_id}-artifacts.tar"',
                                                **web.HEADERS})
            if rest == "/log.txt":
                return self._web_log_text(job_id)
            if rest == "/cancel":
                raise MethodNotAllowed(f"GET is not allowed on {path}: the job page's cancel button posts")
            page = web.job_page(self.service, job_id, self.server.token, query.get("q", [""])[-1])
        elif path in (web.PREFIX, web.PREFIX + "/"):
            page = web.jobs_page(self.service, web.ListQuery.from_query(query))
        elif path == web.PREFIX + "/insights":
            page = web.insights_page(self.service, query.get("repository", [""])[-1][:200],
                                     query.get("since", ["14d"])[-1][:8])
        else:
            raise NoRoute(f"no page {path}; the jobs are at {web.PREFIX}")
        self.respond(page.status, page.body, {"Content-Type": page.content_type, **web.HEADERS})

    def _web_cancel(self, job_id: str) -> None:
        """The job page's cancel button: a same-origin form with the page's CSRF token, then back to the page."""
        assert isinstance(self.server, TcpApiServer)
        form = bytearray()
        empty = self.head.length in (0, None) and "Transfer-Encoding" not in self.headers  # read whole already
        for chunk in () if empty else self._body():
            form += chunk
            if len(form) > web.MAX_FORM:
                self.close_connection = True
                raise TooLarge(f"the form is larger than {web.MAX_FORM} bytes")
        origin = self.headers.get("Origin")
        if origin is not None and origin != f"http://{self.headers.get('Host', '')}":
            raise Forbidden(f"a cancel from another origin ({origin[:100]}) is refused")
        if not web.csrf_ok(self.server.token, job_id, bytes(form)):
            raise Forbidden("the form's CSRF token is missing or wrong: reload the job page and press cancel again")
        self.service.cancel(job_id, "cancelled from the jobs page")
        self.respond(303, b"", {"Location": f"{web.PREFIX}/jobs/{job_id}", **web.HEADERS})

    def _web_log_text(self, job_id: str) -> None:
        job_log = self.service.log_of(job_id)
        self.start_response(200, {"Content-Type": "text/plain; charset=utf-8",
                                  "Content-Disposition": f'attachment; filename="{job_id}.log.txt"', **web.HEADERS})
        for data in web.log_text(job_log):
            self.send_data(data)
        self.end_response()

    def _web_static(self, name: str) -> None:
        asset = web.static(name)
        if asset is None:
            raise NoRoute(f"no file {name!r} under {web.STATIC}")
        self.respond(200, asset.body, {"Content-Type": asset.content_type, **web.HEADERS})

    def _web_logs(self, job_id: str, after: int) -> None:
        """The job API's log stream with each line in the neutralised view the action prints."""
        stream = LogStream(self.service.log_of(job_id).cursor(after), lambda: self._end_line(job_id),
                           web.neutral_log_line, heartbeat=False)  # a browser has no read timeout to feed
        self.start_response(200, {"Content-Type": "application/x-ndjson", **web.HEADERS})
        self.hand_off(stream)


class LogStream:
    """A job's log as the stream thread reads it (runner.httpserve.Stream): the lines committed so far,
    then the end line once the log is closed. A silent job gets an empty line every HEARTBEAT_SECONDS, so
    a client's read timeout tells a live but quiet stream (a job waiting in the queue) from a dead one."""

    def __init__(self, cursor: LogCursor, end: Callable[[], bytes], transform: Callable[[bytes], bytes] | None = None,
                 heartbeat: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self._cursor, self._end, self._transform, self._clock = cursor, end, transform, clock
        self._heartbeat = heartbeat
        self._last = clock()

    def watch(self, wake: Callable[[], None]) -> None:
        self._cursor.watch(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        self._cursor.unwatch(wake)

    def read(self) -> tuple[bytes, bool]:
        lines, ended = self._cursor.read()
        now = self._clock()
        if lines:
            self._last = now
            transform = self._transform
            return b"".join(transform(line) for line in lines) if transform else b"".join(lines), False
        if ended:
            return self._end(), True
        if self._heartbeat and now - self._last >= HEARTBEAT_SECONDS:
            self._last = now
            return b"\n", False
        return b"", False


def is_web_path(path: str) -> bool:
    return path == "/metrics" or path == web.PREFIX or path.startswith(web.PREFIX + "/")


def _wire(parse: Callable[[object], T], data: object) -> T:
    """A request body in one of the contract's shapes (`parse` is its `from_wire`), or a 400 naming the field."""
    try:
        return parse(data)
    except WireError as exc:
        shape = parse.__qualname__.partition(".")[0]  # "JobStarted.from_wire" -> "JobStarted"
        raise BadRequest(f"the body is not a {shape}: {exc}") from exc


def job_route(path: str) -> tuple[str, str] | None:
    """(job id, sub-route such as "/logs" or "") for a path under /v1/jobs/<id>, else None."""
    match = _ROUTE.fullmatch(path)
    return (match.group("id"), match.group("rest") or "") if match else None


def _int_param(query: dict[str, list[str]], name: str, default: int, low: int, high: int) -> int:
    values = query.get(name)
    if not values:
        return default
    value = parse_decimal(values[-1], max_digits=len(str(high)))
    if value is None or not low <= value <= high:
        raise BadRequest(f"query parameter {name}: expected an integer between {low} and {high}, "
                         f"got {values[-1][:40]!r}")
    return value


def limits_for(service: JobService, limits: Limits = LIMITS) -> Limits:
    """Connections for every queued and running job's client (its log stream and one request) on top of
    the listener's own: waiting clients cost an fd each, never a worker."""
    config = service.config
    wanted = 2 * (config.max_queued_jobs + config.max_concurrent_jobs) + 128
    return replace(limits, max_connections=max(limits.max_connections, wanted),
                   max_waiting=max(limits.max_waiting, wanted))


def _urgent(head: Head) -> bool:
    """The fleet's hooks take the reserved workers and go first: a job must always be reported."""
    return urlsplit(head.target).path in HOOK_PATHS


def _caller_gate(service: JobService, tcp: bool, sandboxes: Callable[[], SandboxDesk | None] = lambda: None
                 ) -> Callable[[Head], Refusal | None]:
    """Who is asking, and may they send this body, decided on the head (peer credentials, runner and job
    tokens are all in it): a body is never read for a caller that would be refused after it."""
    access = service.access

    def gate(head: Head) -> Refusal | None:
        if head.method not in ("POST", "PUT"):
            return None  # no body to protect: the route checks as before
        path = urlsplit(head.target).path
        runner_token = head.headers.get(RUNNER_TOKEN_HEADER)
        try:
            if tcp:
                caller = access.tcp_caller(runner_token)
            else:
                assert head.peer is not None
                caller = access.unix_caller(head.peer.sock, runner_token)
            if path in HOOK_PATHS:
                access.require_runner(caller)
            elif path == "/v1/jobs":
                _may_submit(access, caller)
            elif (route := job_route(path)) is not None and route[1] in ("/checkout", "/cancel"):
                access.require_job(caller, route[0], head.headers.get(JOB_TOKEN_HEADER))
            elif (desk := sandboxes()) is not None and sandboxapi.route(path) is not None:
                sandboxapi.vet(desk, access, caller, None if tcp else head.peer.sock, path,  # type: ignore[union-attr]
                               head.headers.get(sandboxapi.SANDBOX_TOKEN_HEADER))
        except JobError as exc:
            return Refusal(status_of(exc), str(exc))
        return None
    return gate


def _may_submit(access: Access, caller: Caller) -> None:
    """What `Access.admit_submit` decides without the spec: a fleet host's plain socket member, and a
    runner whose hook reported no job, may never submit."""
    if caller.operator:
        return
    if caller.runner is None and access.fleet:
        raise Forbidden(f"{caller.who} sent no runner token: on a host with a runner fleet, jobs are "
                        "submitted by the action in a fleet runner's job, which sends its runner token")
    if caller.runner is not None and access.runners.job_of(caller.runner) is None:
        raise Forbidden(f"runner {caller.runner} has not reported a job (its job-started hook did not run), "
                        "so it may not submit one")


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode() + b"\n"


def _token_gate(token: str, then: Callable[[Head], Refusal | None] = lambda head: None
                ) -> Callable[[Head], Refusal | None]:
    """Checked on the head alone: a client without the token never sends its body or takes a worker;
    one with it is then asked `then` (the caller gate)."""
    expected = token.encode()

    def gate(head: Head) -> Refusal | None:
        scheme, _, value = head.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), expected):
            return then(head)
        if _web_token_ok(head, expected):
            return None
        return Refusal(401, "missing or wrong bearer token (Authorization: Bearer <token from the service config>)",
                       (("WWW-Authenticate", "Bearer"),))
    return gate


def _web_token_ok(head: Head, expected: bytes) -> bool:
    """The page's other ways to show the token (web.py): its cookie or `?token=`, on GET/HEAD of /ui only,
    so a cookie a browser sends along can never reach a route that changes anything."""
    path = urlsplit(head.target).path
    ui = web.ui_job_route(path)
    cancel = head.method == "POST" and ui is not None and ui[1] == "/cancel"  # its form's CSRF token is checked too
    if not (head.method in ("GET", "HEAD") or cancel) or path == "/metrics" or not is_web_path(path):
        return False
    offered = web.cookie_token(head.headers.get("Cookie", "")) or web.query_token(head.target)
    return offered is not None and hmac.compare_digest(offered.encode(), expected)


def _no_host_status() -> dict[str, object]:
    return {}


class UnixApiServer(BoundedHTTPServer):
    host_status: Callable[[], dict[str, object]] = staticmethod(_no_host_status)  # GET /v1/status; set by ApiServers
    desk: RunnerDesk | None = None  # the runners' job hooks (POST /v1/runner/...); set by ApiServers
    metrics: JobMetrics | None = None  # the requests it answers are counted there; set by ApiServers
    sandboxes: SandboxDesk | None = None  # the interactive sandboxes (runner/service/sandboxapi.py); set by ApiServers

    def __init__(self, path: str, service: JobService, group: str | None = None, limits: Limits = LIMITS) -> None:
        self.service, self.path = service, path
        _prepare_socket_path(Path(path))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # created 0660 from the start: no window where others could connect
        try:
            listener.bind(path)
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(old)
        listener.listen(1024)
        os.chmod(path, 0o660)
        if group:
            try:
                os.chown(path, -1, grp.getgrnam(group).gr_gid)
            except KeyError:
                listener.close()
                os.unlink(path)
                raise ConfigError(f"socket_group: no group named {group!r} on this host (create it or fix the config)") from None
        super().__init__(listener, Handler, limits, name="api-unix", error_body=_error_body,
                         gate=_caller_gate(service, tcp=False, sandboxes=lambda: self.sandboxes), urgent=_urgent)

    def close(self) -> None:
        super().close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class TcpApiServer(BoundedHTTPServer):
    host_status: Callable[[], dict[str, object]] = staticmethod(_no_host_status)
    desk: RunnerDesk | None = None
    sandboxes: SandboxDesk | None = None

    def __init__(self, address: tuple[str, int], service: JobService, token: str, limits: Limits = LIMITS,
                 metrics: JobMetrics | None = None) -> None:
        self.service, self.token = service, token  # the token also keys the page's CSRF tokens (web.csrf_token)
        self.metrics = metrics or JobMetrics()  # its own registry: several services in one process never collide
        super().__init__(listen_tcp(*address), Handler, limits, name="api-tcp", error_body=_error_body,
                         gate=_token_gate(token, _caller_gate(service, tcp=True, sandboxes=lambda: self.sandboxes)),
                         urgent=_urgent)


def _prepare_socket_path(path: Path) -> None:
    """Create the socket's directory; remove a stale socket, but never one a live service answers on."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"socket: {path} exists and is not a socket; move it away or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a previous service died without cleaning up
        return
    finally:
        probe.close()
    raise ConfigError(f"socket: another service already listens on {path}")


class ApiServers:
    """The Unix server and the optional TCP server, each with its own connection loop and workers."""

    def __init__(self, service: JobService, desk: RunnerDesk | None = None, limits: Limits = LIMITS,
                 metrics: JobMetrics | None = None, host_status: Callable[[], dict[str, object]] | None = None,
                 sandboxes: SandboxDesk | None = None) -> None:
        """`desk` takes the runners' job hooks; `host_status` answers GET /v1/status (the host's VMs, spare
        pools, queue, recent jobs, runners); `sandboxes` serves /v1/sandboxes (none: those routes answer 404)."""
        config = service.config
        limits = limits_for(service, limits)
        unix = UnixApiServer(config.socket, service, config.socket_group, limits)
        self.servers: list[BoundedHTTPServer] = [unix]
        if host_status is not None:
            unix.host_status = host_status
        unix.metrics, unix.desk = metrics, desk
        unix.sandboxes = sandboxes
        if config.listen:
            assert config.token  # the config refuses a listen address without one
            try:
                tcp = TcpApiServer(config.listen, service, config.token, limits, metrics)
            except BaseException:  # e.g. the port is taken: leave no bound Unix socket behind
                self.close()
                raise
            if host_status is not None:
                tcp.host_status = host_status
            tcp.sandboxes, tcp.desk = sandboxes, desk
            self.servers.append(tcp)

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for server in self.servers:
            if isinstance(server, TcpApiServer):
                host, port = server.address[:2]  # a TCP socket's name: (host, port[, flowinfo, scope_id])
                return str(host), int(port)
        return None

    def start(self) -> None:
        for server in self.servers:
            server.start()

    def close(self) -> None:
        for server in self.servers:
            server.close()
