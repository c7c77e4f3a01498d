"""Slow request bodies on the job API's Unix socket hold no worker: other clients' submits and the
fleet's hooks are still served (issue 17: 64 slow `POST /v1/jobs` bodies used to hold all 64 workers,
and every other request got 503).

The service runs in a process of its own (listener_child.py); the slow bodies drip a byte every
half second for longer than a submit takes.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack

from service_fakes import spec
from test_listener_load import child, drip

from runner.jobapi.client import JobClient

SLOW = 100


def test_100_slow_submit_bodies_leave_every_other_request_served() -> None:
    with child("api") as server, ExitStack() as stack:
        path = server.info["socket"]
        slow = []
        for _ in range(SLOW):
            sock = stack.enter_context(socket.socket(socket.AF_UNIX))
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 50000\r\n\r\n{")
            slow.append(sock)
        drip(slow, rounds=2, every=0.5)
        with JobClient(socket=path, timeout=10, retry_statuses=frozenset()) as client:
            assert client.health().ok
            job = client.submit(spec())
        drip(slow, rounds=1, every=0.5)
        during = server.stats()
        print(f"{SLOW} slow bodies: a submit answered {job.state}; server threads {during['threads']}")
        assert job.state == "awaiting_checkout"
        assert during["threads"] < SLOW  # the bodies are read by the connection loop, not by a thread each
