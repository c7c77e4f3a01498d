"""Sandbox calls are bounded before their bodies are read (ATTACK.md finding 1): a PUT of a file takes its
call slot first, and one owner's calls on all its sandboxes share one bounded part of the API's workers."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest

from runner.jobapi.contract import MAX_JSON_BODY
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.sandboxes import MAX_CALLS_PER_OWNER, MAX_CALLS_PER_SANDBOX

BIG = 8 * MAX_JSON_BODY  # past what the connection loop buffers: a worker reads it, after the head's checks


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(str(path))
    return sock


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _create(path: Path) -> str:
    with _connect(path) as sock:
        body = b"{}"
        sock.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        status, rest = _answer(sock)
        assert status == 201, rest
        while not rest.rstrip().endswith(b"}"):
            rest += sock.recv(65536)
        return str(json.loads(rest)["id"])


def _put_head(sock: socket.socket, sandbox_id: str) -> None:
    sock.sendall(f"PUT /v1/sandboxes/{sandbox_id}/files?path=/tmp/f HTTP/1.1\r\nHost: x\r\n"
                 f"Content-Length: {BIG}\r\n\r\n".encode() + b"x" * 4096)


@pytest.fixture
def sandbox_host(hosts: Callable[..., ServiceHost]) -> ServiceHost:
    return hosts(sandboxes={"max_live": 8, "max_per_caller": 8})


def test_puts_past_a_sandboxs_calls_are_refused_before_their_bodies(sandbox_host: ServiceHost) -> None:
    path = sandbox_host.config.socket
    sandbox_id = _create(path)
    with ExitStack() as stack:
        for _ in range(MAX_CALLS_PER_SANDBOX):  # each holds its call while its body trickles in
            _put_head(stack.enter_context(_connect(path)), sandbox_id)
        _wait_calls(sandbox_host, MAX_CALLS_PER_SANDBOX)
        late = stack.enter_context(_connect(path))
        _put_head(late, sandbox_id)  # 4 KiB of BIG sent: the refusal comes without the rest
        status, body = _answer(late)
        assert status == 429, body
        assert b"already runs 4 calls" in body or b"wait for one" in body


def test_one_owners_calls_on_all_its_sandboxes_are_capped(sandbox_host: ServiceHost) -> None:
    path = sandbox_host.config.socket
    desk = sandbox_host.sandboxes
    assert desk is not None and desk.max_owner_calls == MAX_CALLS_PER_OWNER  # 8 x 4 would be 32
    full = MAX_CALLS_PER_OWNER // MAX_CALLS_PER_SANDBOX
    ids = [_create(path) for _ in range(full + 1)]
    with ExitStack() as stack:
        for sandbox_id in ids[:full]:
            for _ in range(MAX_CALLS_PER_SANDBOX):
                _put_head(stack.enter_context(_connect(path)), sandbox_id)
        _wait_calls(sandbox_host, MAX_CALLS_PER_OWNER)
        late = stack.enter_context(_connect(path))
        _put_head(late, ids[-1])  # a sandbox of the same owner with no call of its own yet
        status, body = _answer(late)
        assert status == 429, body
        assert b"sandbox calls at once" in body
    _wait_calls(sandbox_host, 0)  # the held calls ended with their connections: the share is back


def _wait_calls(host: ServiceHost, count: int) -> None:
    import time

    desk = host.sandboxes
    assert desk is not None
    deadline = time.monotonic() + 30
    while sum(s.calls for s in desk.live()) != count:
        assert time.monotonic() < deadline, f"calls held: {sum(s.calls for s in desk.live())}, expected {count}"
        time.sleep(0.02)


