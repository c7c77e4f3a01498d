"""The job API's path table (runner/service/api/paths.py) as a caller meets it: each route on its listeners
only, with its methods and its check, whatever the path's spelling; the page's cookie stands for the
TCP token on the page's routes alone; GET /v1/status (its "listening" too) is the operator's.

Raw requests through a real ServiceHost on the stand-in engine, so what is pinned is what a client gets.
(Written in review: each test here failed on a mutation of the table, the gate or the handler that the
suite before it let through.)"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from http.client import HTTPMessage
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from runner.httpserve import Head, Refusal
from runner.service.api import gates, paths
from runner.service.api.page import COOKIE
from runner.service.api.paths import TCP, UNIX, Check
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.auth import Caller, Forbidden, Kind

TOKEN = "a-test-token-of-32-characters-xx"
STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) ")


def _unix(path: str, request: bytes) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    found = STATUS_LINE.match(data)
    assert found, data[:200]
    return int(found.group(1))


def _get(path: str, target: str, method: str = "GET") -> int:
    return _unix(path, f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())


# -- the table itself ------------------------------------------------------------------------------------

EXPECTED = {  # a path of each route: (listeners, methods, check, urgent, page_token)
    "/metrics": ({TCP}, None, Check.NOTHING, False, False),
    "/ui/jobs/j0123456789abcdef": ({TCP}, None, Check.NOTHING, False, True),
    "/v1/health": ({UNIX, TCP}, {"GET"}, Check.NOTHING, False, False),
    "/v1/attestation-key": ({UNIX, TCP}, {"GET"}, Check.NOTHING, False, False),
    "/v1/sandboxes/j0123456789abcdef/exec": ({UNIX, TCP}, None, Check.SANDBOX, False, False),
    "/v1/jobs": ({UNIX, TCP}, {"GET", "POST"}, Check.SUBMIT, False, False),
    "/v1/status": ({UNIX, TCP}, {"GET"}, Check.NOTHING, False, False),
    "/v1/runner/job-started": ({UNIX, TCP}, None, Check.RUNNER, True, False),
    "/v1/runner/job-completed": ({UNIX, TCP}, None, Check.RUNNER, True, False),
    "/v1/jobs/j0123456789abcdef/cancel": ({UNIX, TCP}, None, Check.JOB, False, False),
}


@pytest.mark.parametrize("path", EXPECTED)
def test_each_route_has_its_listeners_methods_and_check(path: str) -> None:
    listeners, methods, check, urgent, page_token = EXPECTED[path]
    found = paths.find(sorted(methods)[0] if methods else "POST", path, TCP)
    assert found is not None
    route = found.route
    assert (set(route.listeners), None if route.methods is None else set(route.methods), route.check,
            route.urgent, route.page_token) == (listeners, methods, check, urgent, page_token)


@pytest.mark.parametrize("path", ["/v1/jobs/j1\n", "/v1/jobs/j1\x0b", "/v1/jobs/j 1", "/v1/jobs/j1/logsx",
                                  "/v1/jobs/j1/logs/", "/v1/status/", "/v1/statusx", "/metricsx", "/uix",
                                  "/v1/sandboxesx", "/v1/runner/job-startedx", "/xv1/health"])
def test_a_route_matches_its_whole_path(path: str) -> None:
    assert all(paths.find(method, path, listener) is None for method in ("GET", "POST", "PUT")
               for listener in (UNIX, TCP))


# -- through a real service -------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["/metrics", "/ui", "/ui/", "/ui/jobs/j0123456789abcdef",
                                    "/ui/jobs/j0123456789abcdef/terminal.txt", "/ui/static/page.css"])
def test_the_page_and_the_metrics_are_on_no_route_of_the_unix_socket(api: Any, target: str) -> None:
    """The socket's members are not the TCP token's holders: the page (every job's logs, transcripts and
    artifacts) and the metrics are the TCP listener's only."""
    service, _client = api()
    assert _get(service.config.socket, target) == 404


@pytest.mark.parametrize("target", ["//v1/status", "/v1/status/", "/V1/status", "/v1//status", "/v1/status%2F",
                                    "/v1/./status", "/v1/jobs/../status", "/v1/%73tatus", "/./v1/status"])
def test_a_path_spelled_otherwise_is_on_no_route(api: Any, target: str) -> None:
    service, _client = api()
    assert _get(service.config.socket, target) == 404
    assert _get(service.config.socket, "/v1/status?x=/v1/health#frag") == 200  # the query and fragment aside


@pytest.mark.parametrize("method, target, status", [
    ("POST", "/v1/health", 404), ("POST", "/v1/status", 404), ("POST", "/v1/attestation-key", 404),
    ("PUT", "/v1/jobs", 404), ("HEAD", "/v1/status", 501), ("DELETE", "/v1/jobs", 501),
    ("GET", "/v1/runner/job-started", 405),
])
def test_a_method_not_in_a_routes_list_is_refused(api: Any, method: str, target: str, status: int) -> None:
    service, _client = api()
    request = f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    assert _unix(service.config.socket, request.encode()) == status


def test_status_and_its_listening_are_the_operators_only(api: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    service, _client = api()
    assert _get(service.config.socket, "/v1/status") == 200
    monkeypatch.setattr("runner.service.jobs.auth.peer_ids", lambda sock: (4242, 4242))  # a plain socket member
    assert _get(service.config.socket, "/v1/status") == 403
    assert _get(service.config.socket, "/v1/jobs") == 403  # the list of all jobs, likewise


@pytest.fixture
def tcp(hosts: Callable[..., ServiceHost]) -> str:
    host = hosts(listen="127.0.0.1:0", token=TOKEN)
    address = host.api.tcp_address
    return f"http://{address[0]}:{address[1]}"


def test_the_pages_cookie_and_query_token_open_the_page_and_nothing_else(tcp: str) -> None:
    cookies = {COOKIE: TOKEN}
    assert httpx.get(tcp + "/ui", cookies=cookies).status_code == 200
    for target in ("/ui", "/ui/jobs/j0123456789abcdef/terminal.txt", "/ui/jobs/j0123456789abcdef/log.txt"):
        assert httpx.get(tcp + target).status_code == 401, target  # a transcript is the token holder's only
        assert httpx.get(tcp + target, cookies={COOKIE: "not-the-token"}).status_code == 401, target
    for target in ("/metrics", "/v1/status", "/v1/jobs", "/v1/attestation-key"):
        assert httpx.get(tcp + target, cookies=cookies).status_code == 401, target
        assert httpx.get(tcp + target + "?token=" + TOKEN).status_code == 401, target
    host, port = tcp.removeprefix("http://").split(":")
    for target in ("/ui/../metrics", "/ui/%2e%2e/metrics", "/ui/../v1/status", "/ui/..%2Fmetrics"):
        with socket.create_connection((host, int(port)), timeout=30) as sock:  # as sent, never normalised
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nCookie: {COOKIE}={TOKEN}\r\n"
                         "Connection: close\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 404 ") and b"# TYPE" not in answer, (target, answer[:100])
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    status = httpx.get(tcp + "/v1/status", headers=bearer)
    assert status.status_code == 200 and "listening" in status.json()
    assert httpx.get(tcp + "/metrics", headers=bearer).status_code == 200


def test_the_pages_cookie_posts_only_a_cancel(tcp: str) -> None:
    cookies = {COOKIE: TOKEN}
    posted = httpx.post(tcp + "/v1/jobs", cookies=cookies, json={})
    assert posted.status_code == 401
    posted = httpx.post(tcp + "/ui/jobs/j0123456789abcdef/logs", cookies=cookies, content=b"x")
    assert posted.status_code == 401


# -- the gate: each route's check on the head, before a body is read ------------------------------------


class _Access:
    """Access as the gate uses it, the caller fixed: its refusals are the real ones' (Forbidden)."""

    fleet = True

    def __init__(self, caller: Caller, reported: str | None = None) -> None:
        self.caller, self.checked = caller, []  # type: list[object]
        self.runners = SimpleNamespace(job_of=lambda name: reported)

    def tcp_caller(self, runner_token: str | None) -> Caller:
        return self.caller

    def unix_caller(self, sock: object, runner_token: str | None) -> Caller:
        return self.caller

    def require_runner(self, caller: Caller) -> str:
        self.checked.append("runner")
        if caller.runner is None:
            raise Forbidden("not a runner")
        return caller.runner

    def require_job(self, caller: Caller, job_id: str, token: str | None) -> None:
        self.checked.append(("job", job_id, token))
        if not caller.operator:
            raise Forbidden("not this job's")


class _Desk:
    settings = SimpleNamespace(group=None)
    config = SimpleNamespace(runners=SimpleNamespace(runner_user=None))

    def __init__(self) -> None:
        self.found: list[tuple[str, str | None]] = []

    def find(self, sandbox_id: str, token: str | None, operator: bool = False) -> None:
        self.found.append((sandbox_id, token))
        raise Forbidden("not this sandbox's token")


MEMBER, RUNNER = Caller(Kind.MEMBER, "uid 4242"), Caller(Kind.RUNNER, "runner r1", runner="r1")
SANDBOX = "j0123456789abcdef"


def _head(method: str, target: str, **headers: str) -> Head:
    message = HTTPMessage()
    for name, value in {"Content-Length": "2", **headers}.items():
        message[name.replace("_", "-")] = value
    return Head(method, target, message, SimpleNamespace(sock=None))  # type: ignore[arg-type]


def _gate(access: _Access, desk: _Desk | None = None, tcp: bool = False) -> Callable[[Head], Refusal | None]:
    return gates.caller_gate(SimpleNamespace(access=access), tcp, lambda: desk)  # type: ignore[arg-type, return-value]


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
@pytest.mark.parametrize("method, target, caller, reported, check", [
    ("POST", "/v1/runner/job-started", MEMBER, None, "runner"),
    ("POST", "/v1/runner/job-completed?x=1", MEMBER, None, "runner"),
    ("POST", "/v1/jobs", MEMBER, None, None),  # a fleet host's socket member without a runner token
    ("POST", "/v1/jobs", RUNNER, None, None),  # a runner whose hook reported no job
    ("POST", "/v1/jobs/j1/cancel", MEMBER, None, ("job", "j1", "t")),
    ("PUT", "/v1/jobs/j1/checkout", MEMBER, None, ("job", "j1", "t")),
])
def test_the_gate_refuses_on_the_head_what_the_route_would(tcp: bool, method: str, target: str, caller: Caller,
                                                            reported: str | None, check: object) -> None:
    access = _Access(caller, reported)
    refusal = _gate(access, tcp=tcp)(_head(method, target, **{"X-Microvm-Check-Job-Token": "t"}))
    assert refusal is not None and refusal.status == 403, refusal
    assert access.checked == ([check] if check else [])


def test_the_gate_lets_through_what_the_route_decides() -> None:
    assert _gate(_Access(RUNNER, reported="job"))(_head("POST", "/v1/jobs")) is None  # the spec decides the rest
    assert _gate(_Access(Caller(Kind.OPERATOR, "root")))(_head("POST", "/v1/jobs")) is None
    assert _gate(_Access(MEMBER))(_head("GET", "/v1/jobs/j1/logs")) is None  # no body: the route checks
    assert _gate(_Access(MEMBER))(_head("POST", "/v1/health")) is None  # no route: the handler's 404


def test_the_gate_asks_a_sandboxs_token_before_its_body() -> None:
    desk = _Desk()
    refusal = _gate(_Access(MEMBER), desk)(_head("POST", f"/v1/sandboxes/{SANDBOX}/exec", X_Microvm_Check_Sandbox_Token="tok"))
    assert refusal is not None and refusal.status == 403 and desk.found == [(SANDBOX, "tok")]
    put = _gate(_Access(MEMBER), desk)(_head("PUT", f"/v1/sandboxes/{SANDBOX}/files?path=/a", X_Microvm_Check_Sandbox_Token="t2"))
    assert put is not None and desk.found[-1] == (SANDBOX, "t2")


def test_a_chunked_post_is_refused_on_its_head() -> None:
    head = _head("POST", "/v1/jobs", Transfer_Encoding="chunked")
    del head.headers["Content-Length"]
    refusal = _gate(_Access(Caller(Kind.OPERATOR, "root")))(head)
    assert refusal is not None and refusal.status == 411


def test_only_the_fleets_hooks_are_urgent() -> None:
    for listener in (UNIX, TCP):
        urgent = gates.urgent_on(listener)
        assert urgent(_head("POST", "/v1/runner/job-started")) and urgent(_head("POST", "/v1/runner/job-completed"))
        assert not any(urgent(_head("POST", target)) for target in ("/v1/jobs", "/v1/jobs/j1/cancel",
                                                                     f"/v1/sandboxes/{SANDBOX}/exec", "/v1/health"))


def test_the_tcp_token_gate_then_asks_the_caller_gate() -> None:
    asked: list[str] = []

    def then(head: Head) -> Refusal | None:
        asked.append(head.target)
        return Refusal(403, "the caller gate's")

    gate = gates.token_gate(TOKEN, then)
    assert gate(_head("POST", "/v1/jobs", Authorization=f"Bearer {TOKEN}")) == Refusal(403, "the caller gate's")
    assert asked == ["/v1/jobs"]
    refused = gate(_head("POST", "/v1/jobs", Authorization="Bearer not-the-token"))
    assert refused is not None and refused.status == 401 and asked == ["/v1/jobs"]


# -- the handler's bounds ----------------------------------------------------------------------------------


def test_a_json_body_past_its_bound_is_413_and_never_parsed(api: Any) -> None:
    """A body the connection loop does not buffer is read by the worker, held to MAX_JSON_BODY as it comes."""
    from runner.jobapi.contract import MAX_JSON_BODY
    service, _client = api()
    body = b'{"a": "' + b"x" * (MAX_JSON_BODY * 8) + b'"}'
    request = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
               b"Connection: close\r\n\r\n" % len(body))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(service.config.socket)
        sock.sendall(request)
        try:
            sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it stopped reading: the bound held
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:
            pass
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert f"larger than {MAX_JSON_BODY} bytes".encode() in answer


# -- a sandbox's id and token on the other resources' routes ----------------------------------------------


def _request(path: str, method: str, target: str, headers: dict[str, str] | None = None,
             body: bytes = b"") -> tuple[int, bytes]:
    head = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}"
                     "Connection: close\r\n\r\n".encode() + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    found = STATUS_LINE.match(data)
    assert found, data[:200]
    return int(found.group(1)), data


def test_a_sandboxs_token_opens_its_sandbox_routes_only(hosts: Callable[..., ServiceHost],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox is a job record (its id a job id): its token is no job token, and no spelling of its path
    reaches it without the token."""
    import json
    host = hosts(sandboxes={"max_live": 2, "max_per_caller": 2})
    path = host.config.socket
    status, answer = _request(path, "POST", "/v1/sandboxes", {"Content-Type": "application/json"}, b"{}")
    assert status == 201, answer[:300]
    created = json.loads(answer.partition(b"\r\n\r\n")[2])
    sandbox, token = created["id"], created["token"]
    monkeypatch.setattr("runner.service.jobs.auth.peer_ids", lambda sock: (4242, 4242))  # a member, not root
    mine = {"X-Microvm-Check-Sandbox-Token": token}
    assert _request(path, "GET", f"/v1/sandboxes/{sandbox}", mine)[0] == 200
    assert _request(path, "GET", f"/v1/sandboxes/{sandbox}")[0] == 403
    assert _request(path, "POST", f"/v1/sandboxes/{sandbox}/exec", None, b'{"command": "id"}')[0] == 403
    for target in (f"/v1/sandboxes/{sandbox.upper()}", f"/v1/sandboxes/{sandbox}/", f"/v1/sandboxes//{sandbox}",
                   f"/v1/sandboxes/{sandbox}/exec/", f"/v1/sandboxes/x/../{sandbox}", f"/v1/sandboxes/{sandbox}%2Fexec"):
        assert _request(path, "GET", target, mine)[0] == 404, target
    job_token = {"X-Microvm-Check-Job-Token": token}
    for method, target in (("GET", f"/v1/jobs/{sandbox}"), ("GET", f"/v1/jobs/{sandbox}/logs?follow=0"),
                           ("POST", f"/v1/jobs/{sandbox}/cancel"), ("GET", f"/v1/jobs/{sandbox}/terminal")):
        assert _request(path, method, target, {**mine, **job_token})[0] == 403, target
    upgrade = {**mine, "Connection": "Upgrade", "Upgrade": "microvm-check-terminal"}
    status, answer = _request(path, "GET", f"/v1/sandboxes/{sandbox}", upgrade)
    assert status == 200 and b"101" not in answer.split(b"\r\n", 1)[0]  # an upgrade only where a route takes it
