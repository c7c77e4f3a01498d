"""runner.httpserve's worker cap: a request that passed its gate waits for a worker as an fd (no 503, no
thread), urgent requests (the fleet's hooks) have reserved workers, and a handed-off stream frees its
worker at once. A toy handler on loopback, so each rule is seen on its own."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from runner.httpserve import BoundedHTTPServer, Head, ServedRequest, ServerLimits, listen_tcp

RELEASE = threading.Event()


class Handler(ServedRequest):
    def do_GET(self) -> None:
        if self.path == "/slow":
            RELEASE.wait(30)
        if self.path == "/stream":
            self.start_response(200, {"Content-Type": "text/plain"})
            self.hand_off(Ticks())
            return
        self.respond(200, self.path.encode(), {"Content-Type": "text/plain"})


class Ticks:
    """Nothing until RELEASE, then three pieces, one per read, and the end (never blocking)."""

    def __init__(self) -> None:
        self.left = 3

    def read(self) -> tuple[bytes, bool]:
        if not RELEASE.is_set():
            return b"", False
        self.left -= 1
        return b"tick\n", self.left == 0

    def watch(self, wake: object) -> None:
        pass

    def unwatch(self, wake: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[BoundedHTTPServer]:
    RELEASE.clear()
    served = BoundedHTTPServer(listen_tcp("127.0.0.1", 0), Handler, ServerLimits(max_workers=2, reserved_workers=1),
                               name="toy", error_body=lambda m: json.dumps({"error": m}).encode(),
                               urgent=lambda head: head.target == "/hook")
    served.start()
    yield served
    RELEASE.set()
    served.close()


def send(server: BoundedHTTPServer, path: str) -> socket.socket:
    sock = socket.create_connection(server.address[:2], timeout=30)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    return sock


def answer(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def wait_for(condition, limit: float = 10.0) -> None:
    deadline = threading.Event()
    timer = threading.Timer(limit, deadline.set)
    timer.start()
    try:
        while not condition():
            assert not deadline.wait(0.01), "never happened"
    finally:
        timer.cancel()


def test_busy_workers_make_requests_wait_not_fail_and_hooks_take_the_reserved_one(server) -> None:
    first = send(server, "/slow")  # takes the one unreserved worker
    wait_for(lambda: server.stats()["workers"] == 1)
    second = send(server, "/slow")  # waits for it: an fd, no thread, no 503
    wait_for(lambda: server.stats()["waiting"] == 1)
    hook = answer(send(server, "/hook"))  # the reserved worker serves it while both wait
    assert hook.startswith(b"HTTP/1.1 200 ") and hook.endswith(b"/hook")
    RELEASE.set()
    assert answer(first).startswith(b"HTTP/1.1 200 ") and answer(second).startswith(b"HTTP/1.1 200 ")


def test_a_handed_off_stream_frees_its_worker(server) -> None:
    streams = [send(server, "/stream") for _ in range(5)]  # more than the workers, all at once
    wait_for(lambda: server.stats()["streams"] == 5)
    assert server.stats()["workers"] == 0
    RELEASE.set()
    for sock in streams:
        data = answer(sock)
        assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"tick\n") == 3


def test_head_has_its_peer(server) -> None:
    seen: list[Head] = []
    server.gate = lambda head: seen.append(head)
    assert answer(send(server, "/x")).startswith(b"HTTP/1.1 200 ")
    assert seen[0].peer is not None and seen[0].peer.key == "127.0.0.1"
