"""What the job API decides on a request's head, before a body is read or a worker is taken: the TCP
listener's token, and who is asking and whether they may send that body (peer credentials, runner and
job tokens are all in the head). The fleet's hooks are urgent: they take the reserved workers."""

from __future__ import annotations

import hmac
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from runner.errors import JobError
from runner.httpserve import Head, Refusal
from runner.jobapi.contract import JOB_TOKEN_HEADER, RUNNER_TOKEN_HEADER
from runner.service.api import page, paths, sandboxroutes
from runner.service.api.paths import TCP, UNIX, Check, Found
from runner.service.api.refusals import status_of
from runner.service.jobs.auth import Access, Caller, Forbidden

if TYPE_CHECKING:
    from runner.service.jobs.sandboxes import SandboxDesk
    from runner.service.jobs.service import JobService


def urgent_on(listener: str) -> Callable[[Head], bool]:
    """The routes the table calls urgent (the fleet's hooks) take the reserved workers and go first."""

    def urgent(head: Head) -> bool:
        found = paths.find(head.method, urlsplit(head.target).path, listener)
        return found is not None and found.route.urgent
    return urgent


def caller_gate(service: JobService, tcp: bool, sandboxes: Callable[[], SandboxDesk | None] = lambda: None
                ) -> Callable[[Head], Refusal | None]:
    """Who is asking, and may they send this body, decided on the head (peer credentials, runner and job
    tokens are all in it): a body is never read for a caller that would be refused after it. What is
    checked is the path table's (runner/service/api/paths.py)."""
    access = service.access

    def gate(head: Head) -> Refusal | None:
        if head.method not in ("POST", "PUT"):
            return None  # no body to protect: the route checks as before
        if head.method == "POST" and "Transfer-Encoding" in head.headers and head.length is None:
            # a POST's body is JSON, parsed whole: by its length the connection loop reads it within its
            # caller's budget (issue 40); a chunked one would be read and parsed by a worker outside it
            return Refusal(411, "a POST body needs its Content-Length (chunked bodies are for the PUT uploads)")
        found = paths.find(head.method, urlsplit(head.target).path, TCP if tcp else UNIX)
        runner_token = head.headers.get(RUNNER_TOKEN_HEADER)
        try:
            if tcp:
                caller, sock = access.tcp_caller(runner_token), None
            else:
                assert head.peer is not None
                caller, sock = access.unix_caller(head.peer.sock, runner_token), head.peer.sock
            if found is not None:
                _check(found, head, access, caller, sock, sandboxes())
        except JobError as exc:
            return Refusal(status_of(exc), str(exc))
        return None
    return gate


def _check(found: Found, head: Head, access: Access, caller: Caller, sock: socket.socket | None,
           desk: SandboxDesk | None) -> None:
    """The route's check (Check), raising its refusal."""
    check = found.route.check
    if check is Check.RUNNER:
        access.require_runner(caller)
    elif check is Check.SUBMIT:
        _may_submit(access, caller)
    elif check is Check.JOB:
        access.require_job(caller, found.params["id"], head.headers.get(JOB_TOKEN_HEADER))
    elif check is Check.SANDBOX and desk is not None:  # without sandboxes, the route answers 404
        sandboxroutes.vet(desk, access, caller, sock, found.params["path"],
                          head.headers.get(sandboxroutes.SANDBOX_TOKEN_HEADER))


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


def token_gate(token: str, then: Callable[[Head], Refusal | None] = lambda head: None
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
    """The page's other ways to show the token (page.py): its cookie or `?token=`, on GET/HEAD of the routes
    the table lets take it (the page, never /metrics) only, so a cookie a browser sends along can never reach
    a route that changes anything but a job's cancel button (its form's CSRF token is checked too)."""
    path = urlsplit(head.target).path
    found = paths.find(head.method, path, TCP)
    if found is None or not found.route.page_token:
        return False
    ui = page.ui_job_route(path)
    cancel = head.method == "POST" and ui is not None and ui[1] == "/cancel"
    if not (head.method in ("GET", "HEAD") or cancel):
        return False
    offered = page.cookie_token(head.headers.get("Cookie", "")) or page.query_token(head.target)
    return offered is not None and hmac.compare_digest(offered.encode(), expected)
