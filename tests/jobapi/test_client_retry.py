"""The job API client waits out what the service asks it to (503/429 with Retry-After), then gives up in time.

The service is a small HTTP server on 127.0.0.1 that refuses a set number of times before answering, so
each refusal the client meets is a real HTTP answer on a real socket. The whole path (100 clients at
once against `serve` on real VMs) is tests/e2e/test_vm_burst.py.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from runner.jobapi.client import REPLAY_BYTES, JobAPIError, JobClient, retry_delay
from runner.jobapi.contract import JobSpec

SPEC = JobSpec(repository="octo/hello", sha="a" * 40, command="true", timeout_seconds=60)


@dataclass
class Script:
    refusals: int  # answers 503 (or `status`) this many times, then 201/202
    status: int = 503
    retry_after: str | None = "0"
    bodies: list[bytes] = field(default_factory=list)


def start(script: Script) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding") == "chunked":
                data = b""
                while (size := int(self.rfile.readline().strip(), 16)) > 0:
                    data += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return data
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _answer(self) -> None:
            script.bodies.append(self._body())
            if script.refusals > 0:
                script.refusals -= 1
                body = json.dumps({"error": "every worker is busy; try again in 0 s"}).encode()
                self.send_response(script.status)
                if script.retry_after is not None:
                    self.send_header("Retry-After", script.retry_after)
            else:
                body = json.dumps({"id": "j0123456789abcdef", "state": "awaiting_checkout", "token": "t" * 20}).encode()
                self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def served() -> Iterator[callable]:
    servers: list[http.server.ThreadingHTTPServer] = []

    def make(script: Script, **options: object) -> JobClient:
        server, url = start(script)
        servers.append(server)
        said: list[str] = []
        client = JobClient(url=url, token="x", timeout=10, say=said.append, **options)
        client.said = said  # type: ignore[attr-defined]
        client._sleep = lambda seconds: None  # the waits' lengths are retry_delay's, tested below
        return client

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [503, 429])
def test_a_busy_service_is_asked_again_with_one_progress_line(served, status: int) -> None:
    script = Script(refusals=3, status=status)
    client = served(script)
    assert client.submit(SPEC).id == "j0123456789abcdef"
    assert len(script.bodies) == 4 and len(set(script.bodies)) == 1  # the same body each time
    (line,) = client.said
    assert f"{status}" in line and "retrying as the service asks" in line


def test_a_streamed_checkout_is_sent_again_whole() -> None:
    script = Script(refusals=0)
    server, url = start(script)
    try:
        with JobClient(url=url, token="x", timeout=10, say=lambda _: None) as client:
            client._sleep = lambda seconds: None
            client.submit(SPEC)
            script.refusals = 2
            chunks = [bytes([n]) * 100_000 for n in range(5)]
            client.upload_checkout("j0123456789abcdef", iter(chunks))
    finally:
        server.shutdown()
        server.server_close()
    assert script.bodies[1:] == [b"".join(chunks)] * 3


def test_a_streamed_checkout_past_the_replay_buffer_is_not_sent_twice(served) -> None:
    script = Script(refusals=1)
    client = served(script)
    chunks = [b"x" * (1024 * 1024)] * (REPLAY_BYTES // (1024 * 1024) + 1)
    with pytest.raises(JobAPIError, match="503"):
        client.upload_checkout("j0123456789abcdef", iter(chunks))
    assert len(script.bodies) == 1


def test_a_refusal_without_retry_after_or_past_the_deadline_is_final(served) -> None:
    no_hint = Script(refusals=1, retry_after=None)  # e.g. "the service is shutting down"
    with pytest.raises(JobAPIError, match="503"):
        served(no_hint).submit(SPEC)
    assert len(no_hint.bodies) == 1
    hurry = Script(refusals=10, retry_after="5")
    with pytest.raises(JobAPIError, match="503"):
        served(hurry, retry_seconds=1).health()  # 5 s of Retry-After do not fit in 1 s
    assert len(hurry.bodies) == 1


def test_a_client_that_retries_nothing_shows_the_answer(served) -> None:
    script = Script(refusals=1, status=429)
    with pytest.raises(JobAPIError, match="429") as refused:
        served(script, retry_statuses=frozenset()).submit(SPEC)
    assert refused.value.retry_after == 0 and len(script.bodies) == 1


@pytest.mark.parametrize(("asked", "low", "high"), [(None, 5, 7.5), (0, 0.5, 0.75), (10, 10, 15), (3600, 30, 45)])
def test_each_wait_is_retry_after_plus_jitter_within_bounds(asked: float | None, low: float, high: float) -> None:
    assert retry_delay(asked, uniform=lambda a, b: a) == low
    assert retry_delay(asked, uniform=lambda a, b: b) == high
