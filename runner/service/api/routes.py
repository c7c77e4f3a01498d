"""Which route answers a request on the job API: the health and the attestation key (public), the
sandboxes (runner/service/api/sandboxroutes.py), the jobs (runner/service/api/jobroutes.py), the host's status, the
runners' job hooks (answered here, by the runner desk), and on the TCP listener the page and the metrics
(runner/service/api/webroutes.py). A refusal is raised as the service's error; the Handler turns it into its
status (runner.service.api.refusals.STATUS)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import parse_qs, urlsplit

from runner.jobapi.contract import JobStarted, WireError
from runner.service.api import sandboxroutes
from runner.service.api.jobroutes import JobRoutes, job_route
from runner.service.api.refusals import BadRequest, MethodNotAllowed, NoRoute
from runner.service.api.webroutes import WebRoutes, is_web_path
from runner.service.jobs.auth import Forbidden

if TYPE_CHECKING:
    from runner.service.api.handler import Handler

T = TypeVar("T")


def route(h: Handler, method: str) -> None:
    url = urlsplit(h.path)
    query = parse_qs(url.query)
    if h.server.kind == "tcp" and is_web_path(url.path):
        return WebRoutes(h).answer(method, url.path, query)
    if url.path == "/v1/health" and method == "GET":
        return h._send_json(200, h._health().to_wire())
    if url.path == "/v1/attestation-key" and method == "GET":  # public: what verifiers check records with
        return h.respond(200, h.service.attestation_key().encode(), {"Content-Type": "application/x-pem-file"})
    access, caller = h.service.access, h._caller()
    if sandboxroutes.route(url.path) is not None:
        if h.server.sandboxes is None:
            raise NoRoute("this service offers no interactive sandboxes (it runs no VM engine of its own)")
        sock = h._sock if h.server.kind == "unix" else None
        return sandboxroutes.SandboxRoutes(h, h.server.sandboxes).answer(method, url.path, query, caller, sock)
    if url.path == "/v1/jobs" and method in ("POST", "GET"):
        return JobRoutes(h).collection(method, query, caller)
    if url.path == "/v1/status" and method == "GET":
        access.require_operator(caller, "the host's status")
        return h._send_json(200, h.server.host_status())
    if url.path in ("/v1/runner/job-started", "/v1/runner/job-completed"):
        if method != "POST":
            raise MethodNotAllowed(f"{method} is not allowed on {url.path}")
        runner, desk = access.require_runner(caller), h.server.desk
        if desk is None:  # a server built without the host's runner desk (tests of the API alone)
            raise Forbidden("this server takes no runner reports")
        if url.path.endswith("started"):
            started = _wire(JobStarted.from_wire, h._json_body())
            return h._send_json(200, desk.runner_job_started(runner, started).to_wire())
        return h._send_json(200, {"cancelled": desk.runner_job_completed(runner)})
    found = job_route(url.path)
    if found is None:
        raise NoRoute(f"no route {method} {url.path}; see docs/job-api.md")
    job_id, rest = found
    JobRoutes(h).answer(method, url.path, job_id, rest, query, caller)


def _wire(parse: Callable[[object], T], data: object) -> T:
    """A request body in one of the contract's shapes (`parse` is its `from_wire`), or a 400 naming the field."""
    try:
        return parse(data)
    except WireError as exc:
        shape = parse.__qualname__.partition(".")[0]  # "JobStarted.from_wire" -> "JobStarted"
        raise BadRequest(f"the body is not a {shape}: {exc}") from exc
