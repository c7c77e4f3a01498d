"""Strangers cannot starve the webhook before its HMAC is checked: signed deliveries keep being answered
while 64 and 512 connections declare large bodies and send them a byte at a time, reconnecting as
soon as the server closes them.

The webhook runs in a process of its own (listener_child.py). The attackers connect from other
loopback addresses (127.0.0.2...) than the real sender (127.0.0.1), as strangers on the internet come
from other addresses than GitHub. Before issue 17, 64 such bodies of 1 MiB filled the 64 MiB body
budget for ~26 s each and every real delivery got 503. Timings are printed; the assertions are the
outcome (every delivery 200 within the client's timeout) and that the attack really ran (it opened
every connection at least twice; how many the server let it hold at once is printed).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.service.api.test_listener_load import child, signed_ping

ATTACK_HEAD = ("POST /github/webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Content-Length: {length}\r\nX-GitHub-Event: workflow_job\r\nX-GitHub-Delivery: slow\r\n"
               "X-Hub-Signature-256: sha256=" + "0" * 64 + "\r\n\r\n")
DELIVERIES = 10


class SlowBodies:
    """`count` connections spread over `sources` loopback addresses, each declaring `length` bytes and
    sending one every `every` seconds; a connection the server closes is opened again at once."""

    def __init__(self, port: int, count: int, sources: int, length: int, every: float = 0.25) -> None:
        self.port, self.count, self.sources, self.length, self.every = port, count, sources, length, every
        self.opened = 0
        self.live = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._socks: list[socket.socket | None] = [None] * count

    def __enter__(self) -> SlowBodies:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self._socks:
            if sock is not None:
                sock.close()

    def _open(self, n: int) -> socket.socket | None:
        sock = socket.socket()
        sock.settimeout(2)
        try:
            sock.bind((f"127.0.0.{2 + n % self.sources}", 0))
            sock.connect(("127.0.0.1", self.port))
            sock.sendall(ATTACK_HEAD.format(length=self.length).encode())
        except OSError:
            sock.close()
            return None
        sock.setblocking(False)
        self.opened += 1
        return sock

    def _run(self) -> None:
        while not self._stop.is_set():
            live = 0
            for n, sock in enumerate(self._socks):
                if sock is not None:
                    try:
                        if sock.recv(4096) == b"":  # the server answered or closed: that one is done
                            raise ConnectionResetError
                    except BlockingIOError:
                        try:
                            sock.send(b" ")
                            live += 1
                            continue
                        except OSError:
                            pass
                    except OSError:
                        pass
                    sock.close()
                self._socks[n] = self._open(n)
            self.live = live
            self._stop.wait(self.every)


@pytest.mark.parametrize(("count", "sources", "max_body"), [(64, 1, 1024 * 1024), (512, 8, None)],
                         ids=["64-slow-1MiB-bodies", "512-slow-bodies-from-8-sources"])
def test_signed_deliveries_are_answered_while_slow_bodies_attack(count: int, sources: int, max_body: int | None) -> None:
    extra = ["--max-body", str(max_body)] if max_body else []
    with child("webhook", *extra) as server:
        port = server.info["port"]
        with SlowBodies(port, count, sources, server.info["max_body"]) as attack:
            deadline = time.monotonic() + 30
            while attack.opened < 2 * count and time.monotonic() < deadline:  # in place, and renewing
                time.sleep(0.1)
            held = attack.live
            answers = [signed_ping(port) for _ in range(DELIVERIES)]
            opened = attack.opened
        slowest = max(latency for _, latency in answers)
        print(f"{count} slow bodies from {sources} source(s): {DELIVERIES} signed deliveries, slowest answered in "
              f"{slowest * 1000:.0f} ms; {held} attack connections held, {opened} opened in all")
        assert opened >= 2 * count, "the attack never got going: the test proves nothing"
        assert [status for status, _ in answers] == [200] * DELIVERIES
