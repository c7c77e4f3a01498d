"""Each pre-authentication limit of the bounded HTTP server (runner/httpserve.py) on its own.

The webhook and the job API stack several of them (per-peer connections, per-peer bodies, the body
budget's eviction of the slowest, a minimum rate all along, deadlines), so an attack that one stops
is often stopped by another too, and removing one fails no load test. Here a server over loopback
TCP gets limits that leave exactly one of them in play, and the test shows that one acting: the
attacker's connections come from 127.0.0.2 (a peer of its own), the real client from 127.0.0.1.
The source allowlist is driven from the webhook's own config (WebhookConfig.allow_sources).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from runner.httpserve import BoundedHTTPServer, Head, ServedRequest, ServerLimits, _peer_key, listen_tcp

ATTACKER = "127.0.0.2"


class Echo(ServedRequest):
    """GET: "ok" (GET /slow waits for the test's `release` first); POST: how many body bytes arrived."""

    release = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/slow":
            self.release.wait(30)
        self.respond(200, b"ok", {"Content-Type": "text/plain"})

    def do_POST(self) -> None:
        size = sum(len(piece) for piece in self.body())
        self.respond(200, str(size).encode(), {"Content-Type": "text/plain"})


@contextlib.contextmanager
def serving(limits: ServerLimits, urgent: Callable[[Head], bool] | None = None) -> Iterator[int]:
    Echo.release = threading.Event()
    server = BoundedHTTPServer(listen_tcp("127.0.0.1", 0), Echo, limits, name="test-limits",
                               error_body=lambda message: message.encode(), urgent=urgent)
    server.start()
    try:
        yield server.address[1]
    finally:
        Echo.release.set()
        server.close()


def connect(port: int, source: str = "127.0.0.1", first: bytes = b"") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    if first:
        sock.sendall(first)
    return sock


def answer(sock: socket.socket, timeout: float = 5.0) -> bytes | None:
    """The status line's code and what follows (b"" when closed without an answer), or None: nothing yet."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except TimeoutError:
        return None if not data else data
    except ConnectionResetError:
        return data
    return data


def get(port: int, path: str = "/", source: str = "127.0.0.1") -> bytes | None:
    with connect(port, source, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()) as sock:
        return answer(sock)


def post_head(length: int) -> bytes:
    return f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n".encode()


def test_a_peer_past_its_connection_share_is_answered_503_while_others_are_served() -> None:
    limits = ServerLimits(max_connections=64, max_per_peer=4, evict_after_seconds=60.0, idle_seconds=30.0)
    with serving(limits) as port, contextlib.ExitStack() as stack:
        for _ in range(4):
            stack.enter_context(connect(port, ATTACKER))
        time.sleep(0.3)  # all four are in the loop
        extra = stack.enter_context(connect(port, ATTACKER))
        refused = answer(extra)
        assert refused is not None and refused.startswith(b"HTTP/1.1 503")
        assert (get(port) or b"").startswith(b"HTTP/1.1 200")  # another peer is not held up


def test_at_the_peer_cap_only_a_connection_older_than_evict_after_gives_way() -> None:
    # 3 s: the refusal of the young third must come before the oldest is old enough, also on a busy machine.
    limits = ServerLimits(max_connections=64, max_per_peer=2, evict_after_seconds=3.0, idle_seconds=30.0)
    with serving(limits) as port, contextlib.ExitStack() as stack:
        oldest = stack.enter_context(connect(port, ATTACKER))
        stack.enter_context(connect(port, ATTACKER))
        time.sleep(0.2)
        young = answer(stack.enter_context(connect(port, ATTACKER)))  # none is 3 s old yet
        assert young is not None and young.startswith(b"HTTP/1.1 503")
        time.sleep(3.2)
        with connect(port, ATTACKER, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") as later:
            assert (answer(later) or b"").startswith(b"HTTP/1.1 200")  # the oldest made room ...
        assert answer(oldest, 2.0) == b""  # ... by being closed


def test_a_connection_that_never_sends_a_byte_is_closed_at_idle_seconds() -> None:
    with serving(ServerLimits(idle_seconds=1.0, head_seconds=30.0)) as port, connect(port) as silent:
        started = time.monotonic()
        assert answer(silent, 6.0) == b""
        assert time.monotonic() - started < 4.0


def test_a_buffered_body_must_keep_up_its_minimum_rate_all_along_not_only_by_its_deadline() -> None:
    # 100 kB at 1 kB/s after 1 s of grace: the deadline is 101 s away, but 1 byte per 0.5 s is far behind
    limits = ServerLimits(buffer_body_max=1 << 20, body_seconds=1.0, body_min_rate=1000)
    with serving(limits) as port, connect(port, ATTACKER, post_head(100_000)) as slow:
        slow.settimeout(0.5)
        started, cut = time.monotonic(), False
        while time.monotonic() - started < 8.0 and not cut:
            try:
                slow.send(b"x")
                cut = slow.recv(65536) is not None  # an answer (408) or b"": cut off either way
            except TimeoutError:
                pass
            except OSError:
                cut = True
        assert cut and time.monotonic() - started < 6.0


def test_a_peer_past_its_body_share_loses_its_slowest_body_and_the_newcomer_is_served() -> None:
    limits = ServerLimits(buffer_body_max=1 << 20, max_bodies_per_peer=2, body_seconds=30.0, body_min_rate=1)
    with serving(limits) as port, contextlib.ExitStack() as stack:
        slowest = stack.enter_context(connect(port, ATTACKER, post_head(1000) + b"x"))
        faster = stack.enter_context(connect(port, ATTACKER, post_head(1000) + b"y" * 500))
        other = stack.enter_context(connect(port, "127.0.0.3", post_head(1000) + b"z"))  # another peer's body
        time.sleep(1.2)  # rated by bytes per second: `slowest` is the slowest of its peer's
        newcomer = stack.enter_context(connect(port, ATTACKER, post_head(10)))
        time.sleep(0.5)
        newcomer.sendall(b"0123456789")
        assert (answer(newcomer) or b"").startswith(b"HTTP/1.1 200")
        evicted = answer(slowest, 2.0)
        assert evicted is not None and evicted.startswith(b"HTTP/1.1 503"), evicted
        faster.sendall(b"y" * 500)
        other.sendall(b"z" * 999)
        assert (answer(faster) or b"").startswith(b"HTTP/1.1 200")
        assert (answer(other) or b"").startswith(b"HTTP/1.1 200")


def test_reserved_workers_serve_an_urgent_request_while_the_others_are_taken() -> None:
    limits = ServerLimits(max_workers=2, reserved_workers=1, wait_seconds=30.0)
    with serving(limits, urgent=lambda head: head.target == "/urgent") as port, contextlib.ExitStack() as stack:
        stack.enter_context(connect(port, first=b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"))  # holds the one worker
        time.sleep(0.3)
        waiting = stack.enter_context(connect(port, first=b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert (get(port, "/urgent") or b"").startswith(b"HTTP/1.1 200")  # the reserved worker
        assert answer(waiting, 1.0) is None  # the other non-urgent one waits: the reserve is not its


def test_ipv6_peers_of_one_64_share_their_budgets_and_mapped_ipv4_is_its_ipv4() -> None:
    with socket.socket() as sock:
        assert _peer_key(sock, ("2001:db8:1:2::1", 0, 0, 0)) == _peer_key(sock, ("2001:db8:1:2:ffff::9", 0, 0, 0))
        assert _peer_key(sock, ("2001:db8:1:2::1", 0, 0, 0)) != _peer_key(sock, ("2001:db8:1:3::1", 0, 0, 0))
        assert _peer_key(sock, ("::ffff:192.0.2.7", 0, 0, 0)) == _peer_key(sock, ("192.0.2.7", 0)) == "192.0.2.7"


def test_the_webhook_serves_only_its_configured_sources() -> None:
    from runner.github.webhooks import WebhookConfig, WebhookReceiver, WebhookServer

    class NoHooks:
        def prewarm(self, job: object) -> None:
            pass

        def job_completed(self, job: object) -> None:
            pass

    config = WebhookConfig(secret=b"s" * 32, labels=("microvm",),
                           allow_sources=(ipaddress.ip_network("127.0.0.1/32"),))
    server = WebhookServer(WebhookReceiver(config, NoHooks()))
    server.start()
    try:
        request = b"GET /github/webhook HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        with connect(server.port, "127.0.0.1", request) as allowed:
            assert (answer(allowed) or b"").startswith(b"HTTP/1.1 ")  # answered (405: GET), by the webhook
        with connect(server.port, ATTACKER, request) as stranger:
            assert answer(stranger) == b""  # closed at accept: not even an answer
    finally:
        server.close()


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = [t for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith("test-limits")]
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"threads left running: {left}")

