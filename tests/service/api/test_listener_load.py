"""Both listeners under connection floods, each in a process of its own (tests/service/api/listener_child.py).

Every flood goes to loopback and ends by itself: a fixed number of sockets, a fixed number of
drip rounds. Latency is printed, not asserted; the assertion is the answer arriving before the
client's 10 s timeout, and the server's fds and threads staying within its caps.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from runner.github.signature import sign
from runner.jobapi.client import JobClient
from tests.service.api.listener_child import SECRET, TOKEN
from tests.service.service_fakes import spec

CHILD = Path(__file__).with_name("listener_child.py")
CLIENT_TIMEOUT = 10.0
PING = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1}).encode()


class Child:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.info = json.loads(proc.stdout.readline())

    def stats(self) -> dict:
        """Its open fds, threads and CPU seconds, read from outside."""
        proc = f"/proc/{self.proc.pid}"
        fields = Path(f"{proc}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        return {"fds": len(os.listdir(f"{proc}/fd")), "threads": len(os.listdir(f"{proc}/task")), "cpu": cpu}


@contextmanager
def child(kind: str, *args: str) -> Iterator[Child]:
    proc = subprocess.Popen([sys.executable, "-I", str(CHILD), kind, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield Child(proc)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def open_flood(stack: ExitStack, port: int, count: int, first: bytes = b"", pace: float = 0.0) -> list[socket.socket]:
    """`count` connections, each sending `first`; `pace` seconds apart lets a small accept backlog take them all."""
    socks = []
    for _ in range(count):
        time.sleep(pace)
        sock = stack.enter_context(socket.socket())
        sock.settimeout(CLIENT_TIMEOUT)
        sock.connect(("127.0.0.1", port))
        if first:
            send_quietly(sock, first)
        socks.append(sock)
    return socks


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """The server may have closed a flooding connection to make room: that is its right."""
    try:
        sock.send(data)
    except OSError:
        pass


def drip(socks: list[socket.socket], rounds: int, every: float) -> None:
    for _ in range(rounds):
        time.sleep(every)
        for sock in socks:
            send_quietly(sock, b"X")


def signed_ping(port: int) -> tuple[int, float]:
    request = (f"POST /github/webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(PING)}\r\nX-GitHub-Event: ping\r\nX-GitHub-Delivery: 0c7e4e3a-load\r\n"
               f"X-Hub-Signature-256: {sign(SECRET, PING)}\r\nConnection: close\r\n\r\n").encode() + PING
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=CLIENT_TIMEOUT) as sock:
        sock.sendall(request)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return int(answer.split(b" ", 2)[1]), time.monotonic() - started


def submit(port: int) -> tuple[str, float]:
    started = time.monotonic()
    job = JobClient(url=f"http://127.0.0.1:{port}", token=TOKEN, timeout=CLIENT_TIMEOUT).submit(spec())
    return job.state, time.monotonic() - started


@pytest.mark.parametrize("leave_free", [None, 20], ids=["at-the-cap", "out-of-fds"])
def test_webhook_under_ulimit_256_does_not_spin_and_still_delivers(leave_free: int | None) -> None:
    """254 connections dripping a byte every 2 s, open-file limit 256 (and, second, only 20 fds free)."""
    extra = ["--leave-free", str(leave_free)] if leave_free is not None else []
    with child("webhook", "--nofile", "256", *extra) as server, ExitStack() as stack:
        socks = open_flood(stack, server.info["port"], 254, b"POST /github/webhook HTTP/1.1\r\n", pace=0.005)
        before, started = server.stats(), time.monotonic()
        drip(socks, rounds=3, every=2.0)
        status, latency = signed_ping(server.info["port"])
        after, wall = server.stats(), time.monotonic() - started
        print(f"signed delivery under the flood: {latency * 1000:.0f} ms; server CPU "
              f"{after['cpu'] - before['cpu']:.2f} s in {wall:.1f} s; fds {after['fds']}")
        assert status == 200
        assert after["cpu"] - before["cpu"] < 0.3 * wall  # a spinning accept loop takes a core
        assert after["fds"] <= 256


LISTENERS: dict[str, tuple[bytes, Callable[[int], tuple[object, float]], object]] = {
    "webhook": (b"POST /github/webhook HTTP/1.1\r\nContent-Type: application/json\r\n", signed_ping, 200),
    "api": (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n", submit, "awaiting_checkout"),
}


@pytest.mark.parametrize("kind", sorted(LISTENERS))
def test_500_idle_and_200_slow_connections_leave_room_for_a_real_client(kind: str) -> None:
    start, ask, expected = LISTENERS[kind]
    with child(kind) as server, ExitStack() as stack:
        port, caps = server.info["port"], server.info
        baseline = server.stats()
        open_flood(stack, port, 500)
        slow = open_flood(stack, port, 200, start)
        drip(slow, rounds=3, every=1.0)
        during = server.stats()  # before the real request, whose job opens files of its own
        answer, latency = ask(port)
        print(f"{kind}: answered in {latency * 1000:.0f} ms under 700 connections; fds {baseline['fds']} -> "
              f"{during['fds']} (cap {caps['max_connections']}), threads {baseline['threads']} -> "
              f"{during['threads']} (cap {caps['max_workers']} workers)")
        assert answer == expected
        assert during["fds"] <= baseline["fds"] + caps["max_connections"]
        assert during["threads"] <= baseline["threads"] + caps["max_workers"]
