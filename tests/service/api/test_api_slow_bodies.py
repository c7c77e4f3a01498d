"""Slow request bodies on the job API's Unix socket hold no worker: other clients' submits and the
fleet's hooks are still served (issue 17: 64 slow `POST /v1/jobs` bodies used to hold all 64 workers,
and every other request got 503). One uid's large JSON bodies are read and parsed only a few at a time,
so a flood of them leaves health answered (issue 40, item 9).

The service runs in a process of its own (listener_child.py); the slow bodies drip a byte every
half second for longer than a submit takes.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

from runner.jobapi.client import JobClient
from runner.jobapi.contract import MAX_COMMAND_BYTES
from runner.service.api.listeners import PEER_BODY_BYTES, PEER_SMALL_BODY
from tests.service.api.test_listener_load import child, drip
from tests.service.service_fakes import spec

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


# -- one peer's large JSON bodies (issue 40, item 9) ---------------------------------------------------

FLOOD, HEALTH_BOUND = 64, 3.0  # before, health waited 5 to 11 s behind such a flood; now tens of ms
FLOOD_CLIENT = """
import json, socket, sys, threading
path, count = sys.argv[1], int(sys.argv[2])
body = b"[" + b"[]," * ((1024 * 1024 - 2) // 3) + b"]"  # 1 MiB of lists, which json.loads made one by one
request = (b"POST /v1/jobs HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\nConnection: close\\r\\n"
           b"Content-Length: %d\\r\\n\\r\\n" % len(body)) + body
statuses = []
def submit():
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(120)
        sock.connect(path)
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    statuses.append(answer[9:12].decode())
threads = [threading.Thread(target=submit) for _ in range(count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(sorted(statuses)))
"""


def raw_answer(sock: socket.socket, timeout: float) -> bytes:
    """What the server answered before closing, or before `timeout` (b"": nothing at all)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                break
    except TimeoutError:
        pass
    return data


def submit_request(job: dict) -> bytes:
    body = json.dumps(job).encode()
    return (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def feed(socks: list[socket.socket], stop: threading.Event) -> None:
    """64 KiB of JSON whitespace to each, every 0.25 s, for at most 3.5 s: less than their 1 MiB."""
    for _ in range(14):
        if stop.wait(0.25):
            return
        for sock in socks:
            sock.sendall(b" " * 65536)


def test_one_peers_large_bodies_in_hand_hold_back_its_next_large_one_not_its_small_ones(api) -> None:
    """Two 1 MiB bodies arriving (fed at 256 KiB/s: they keep up) fill the uid's PEER_BODY_BYTES: its next large
    submit (a 64 KiB command) waits, unread, until one of them is done with; its small submit and its health
    are answered meanwhile."""
    service, client = api()
    path = service.config.socket
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {PEER_BODY_BYTES // 2}\r\n\r\n{{").encode()
    large_submit = submit_request(spec("x" * MAX_COMMAND_BYTES))
    assert len(large_submit) > PEER_SMALL_BODY
    with ExitStack() as stack:
        def connected() -> socket.socket:
            sock = stack.enter_context(socket.socket(socket.AF_UNIX))
            sock.connect(path)
            return sock

        arriving = [connected() for _ in range(2)]
        for sock in arriving:
            sock.sendall(head)
        stop = threading.Event()
        feeder = threading.Thread(target=feed, args=(arriving, stop))
        feeder.start()
        stack.callback(feeder.join)
        stack.callback(stop.set)
        late = connected()
        late.sendall(large_submit)
        assert raw_answer(late, 1.0) == b""  # its uid has 2 MiB in hand: it waits its turn
        small = connected()
        small.sendall(submit_request(spec()))
        answer = raw_answer(small, 10.0)
        assert answer.startswith(b"HTTP/1.1 201"), answer[:300]  # small: never behind the uid's large bodies
        assert client.health().ok
        stop.set()
        feeder.join()
        arriving[0].close()  # one large body is given up: the waiting submit is read and served
        answer = raw_answer(late, 10.0)
        assert answer.startswith(b"HTTP/1.1 201"), answer[:300]


def test_a_body_of_more_than_10000_arrays_and_objects_is_refused_before_it_is_parsed(api) -> None:
    service, _ = api()
    body = b"[" + b"[]," * 10_000 + b"[]]"  # 10,002: each would be an object for json.loads to make
    request = (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
               ).encode() + body
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(service.config.socket)
        sock.sendall(request)
        answer = raw_answer(sock, 10.0)
        answer += raw_answer(sock, 10.0)
    assert answer.startswith(b"HTTP/1.1 400") and b"more than 10000 arrays and objects" in answer, answer[:300]


def test_64_large_submits_from_one_peer_leave_health_answered() -> None:
    """The issue's flood: 64 submits of 1 MiB at once from one uid (another process), health asked again and
    again meanwhile. A bounded check, not a timing: each health answer must come before HEALTH_BOUND."""
    with child("api") as server:
        path = server.info["socket"]
        flood = subprocess.Popen([sys.executable, "-c", FLOOD_CLIENT, path, str(FLOOD)], stdout=subprocess.PIPE,
                                 text=True)
        latencies = []
        try:
            while flood.poll() is None or not latencies:
                started = time.monotonic()
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(path)
                    sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    answer = raw_answer(sock, HEALTH_BOUND)
                latencies.append(time.monotonic() - started)
                assert answer.startswith(b"HTTP/1.1 200"), f"health unanswered after {latencies[-1]:.1f} s"
                time.sleep(0.02)
            statuses = json.loads(flood.communicate(timeout=120)[0])
        finally:
            if flood.poll() is None:
                flood.kill()
                flood.wait()
        print(f"{len(latencies)} health answers during the flood: median {statistics.median(latencies) * 1000:.0f} ms,"
              f" slowest {max(latencies) * 1000:.0f} ms")
        assert statuses == ["400"] * FLOOD  # every submit answered (refused: it is no JobSpec), none lost


def test_a_chunked_post_body_is_411_before_it_is_read(api) -> None:
    """A POST's JSON must say its length: read by the loop, it counts against its caller's budget; a chunked
    one would have been read and parsed by a worker, outside it (64 of 1 MiB held health 2 s)."""
    service, _ = api()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(service.config.socket)
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n")  # the rest never comes: it is not read
        answer = raw_answer(sock, 10.0)
        answer += raw_answer(sock, 10.0)
    assert answer.startswith(b"HTTP/1.1 411") and b"needs its Content-Length" in answer, answer[:300]
