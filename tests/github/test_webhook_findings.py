"""The webhook's fuzz findings of issue 17, and its source allowlist, over real sockets on loopback."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from ipaddress import ip_network

import pytest

from runner.github.signature import sign
from runner.github.webhooks import WebhookConfig, WebhookReceiver, WebhookServer

SECRET = b"findings-secret"
PING = json.dumps({"zen": "Design for failure.", "hook_id": 7, "padding": "x" * 4000}).encode()


class NoHooks:
    def prewarm(self, job: object) -> None:
        pass

    def job_completed(self, job: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[callable]:
    servers: list[WebhookServer] = []

    def start(**config: object) -> int:
        server = WebhookServer(WebhookReceiver(WebhookConfig(secret=SECRET, labels=("microvm",), **config), NoHooks()))
        server.start()
        servers.append(server)
        return server.port

    yield start
    for server in servers:
        server.close()


def head(length: int, signature: str) -> bytes:
    return (f"POST /github/webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n"
            f"X-GitHub-Event: ping\r\nX-GitHub-Delivery: f1nd1ngs\r\nX-Hub-Signature-256: {signature}\r\n\r\n").encode()


def answer_of(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_signed_delivery_cut_short_and_half_closed_is_answered_400(webhook) -> None:
    port = webhook()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head(len(PING), sign(SECRET, PING)) + PING[:-1000])
        sock.shutdown(socket.SHUT_WR)
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"ended before its Content-Length" in answer


def test_a_nul_in_the_signature_header_is_400_without_the_header_echoed(webhook) -> None:
    port = webhook()
    signature = sign(SECRET, PING) + "\0secret-looking-tail"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head(len(PING), signature) + PING)
        answer = answer_of(sock)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"secret-looking-tail" not in answer and b"sha256=" not in answer


def test_only_allowed_sources_are_served(webhook) -> None:
    port = webhook(allow_sources=(ip_network("127.0.0.1/32"),))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head(len(PING), sign(SECRET, PING)) + PING)
        assert answer_of(sock).startswith(b"HTTP/1.1 200 ")
    with socket.socket() as sock:
        sock.settimeout(10)
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", port))
        try:
            sock.sendall(head(len(PING), sign(SECRET, PING)) + PING)
            answer = answer_of(sock)
        except ConnectionResetError:
            answer = b""
    assert answer == b""  # closed at accept: not a byte read, not a byte answered
