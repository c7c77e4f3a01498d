"""An empty body (`Content-Length: 0`) is answered at once on every route that takes a body (issue 40,
item 7): the job API's, the sandboxes' and the jobs page's on a real `ServiceHost` (what `serve`
builds), and the GitHub webhook's.

Before, h11 had already given the empty body's end with the head, and the handler's read of the body
then waited in `recv` for bytes that never came: 30 s on the API, 2 s on the webhook, a worker held
all along, and then the connection was dropped without an answer. Here every request gets its
status on a socket whose timeout (10 s) is far beyond an answer's time and short of the old wait:
a bounded check, not a timing.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.httpserve import ServerLimits
from runner.sandbox.fake import FakeSandboxes
from runner.service.host.assembly import ServiceHost
from tests.service.service_fakes import spec
from tests.test_httpserve_limits import answer, connect, post_head, serving

TIMEOUT = 10.0  # the API's old wait was 30 s; the webhook's, 2 s then no answer at all
TOKEN = "empty-body-token-0123456789"


def ask(address: str | tuple[str, int], request: bytes) -> bytes:
    """The server's answer to `request`, up to its end (every answer here says `Connection: close`), or
    what came of it before TIMEOUT."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    answer = b""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT)
        sock.connect(address)
        sock.sendall(request)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except TimeoutError:
            pass
    return answer


def status_of(answer: bytes) -> int:
    match = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert match, f"no answer within {TIMEOUT:g} s: {answer[:200]!r}"
    return int(match.group(1))


def empty(method: str, target: str, *headers: str) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: x", "Content-Length: 0", "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def post_json(address: str, target: str, body: bytes) -> dict:
    answer = ask(address, f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                          f"Connection: close\r\n\r\n".encode() + body)
    assert status_of(answer) in (200, 201), answer[:300]
    return json.loads(answer.partition(b"\r\n\r\n")[2])


@pytest.fixture
def host(hosts: Callable[..., ServiceHost], short_dir: Path) -> ServiceHost:
    (short_dir / "webhook-secret").write_text("empty-body-webhook-secret\n")
    return hosts(listen="127.0.0.1:0", token=TOKEN, sandboxes={"max_live": 4, "max_per_caller": 4},
                 webhook={"listen": "127.0.0.1:0", "secret_path": str(short_dir / "webhook-secret")})


def test_an_empty_body_is_answered_at_once_on_every_route_that_takes_one(host: ServiceHost, engine: FakeSandboxes) -> None:
    sock = str(host.config.socket)
    job = post_json(sock, "/v1/jobs", json.dumps(spec()).encode())["id"]
    sandbox = post_json(sock, "/v1/sandboxes", b"{}")["id"]
    vm = engine.created[-1]
    assert host.api is not None and host.api.tcp_address is not None and host.webhook is not None
    tcp, bearer = host.api.tcp_address, f"Authorization: Bearer {TOKEN}"
    routes: list[tuple[str | tuple[str, int], bytes, int]] = [
        (sock, empty("POST", "/v1/jobs"), 400),  # no JobSpec
        (sock, empty("POST", "/v1/sandboxes"), 400),  # no request object
        (sock, empty("PUT", f"/v1/jobs/{job}/checkout"), 400),  # no tar
        (sock, empty("POST", "/v1/runner/job-started"), 403),  # the operator is no runner
        (sock, empty("POST", "/v1/runner/job-completed"), 403),
        (sock, empty("POST", f"/v1/sandboxes/{sandbox}/exec"), 400),  # no command
        (sock, empty("PUT", f"/v1/sandboxes/{sandbox}/files?path=/tmp/empty"), 204),  # the SDK's files.write(p, b"")
        (sock, empty("PUT", f"/v1/sandboxes/{sandbox}/upload"), 400),  # no tar
        (sock, empty("POST", f"/v1/sandboxes/{sandbox}/snapshot"), 400),  # this host runs no engine of its own
        (tcp, empty("POST", f"/ui/jobs/{job}/cancel", bearer), 403),  # the page's form, without its CSRF token
        (("127.0.0.1", host.webhook.port), empty("POST", "/github/webhook", "Content-Type: application/json",
                                                 "X-GitHub-Event: ping", "X-GitHub-Delivery: empty-1"), 403),  # unsigned
        (sock, empty("POST", f"/v1/jobs/{job}/cancel"), 202),
        (sock, empty("POST", f"/v1/sandboxes/{sandbox}/destroy"), 200),
    ]
    for address, request, expected in routes:
        status = status_of(ask(address, request))
        line = request.split(b"\r\n", 1)[0].decode()
        print(f"{line}: {status}")
        assert status == expected, line
    assert vm.files == {"/tmp/empty": b""}


@pytest.mark.parametrize("buffered", [0, 1 << 20], ids=["read-by-the-worker", "read-by-the-loop"])
def test_an_empty_body_is_read_whole_and_the_connection_serves_the_next_request(buffered: int) -> None:
    """On the server alone (a handler that reads the body, on either listener's kind of body reading): the
    empty body is read at once, and the kept-alive connection takes a request sent after the answer."""
    with serving(ServerLimits(buffer_body_max=buffered)) as port, connect(port) as sock:
        sock.sendall(post_head(0))
        first = answer(sock, TIMEOUT)
        assert first is not None and first.startswith(b"HTTP/1.1 200") and first.endswith(b"\r\n\r\n0"), first
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        second = answer(sock, TIMEOUT)
        assert second is not None and second.startswith(b"HTTP/1.1 200"), second
