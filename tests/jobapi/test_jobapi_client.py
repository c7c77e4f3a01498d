"""The job API client (runner/jobapi/client.py) against the real API server on a Unix socket, and
against raw sockets where the service itself would never misbehave."""

from __future__ import annotations

import io
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import Health, JobRecord, JobSpec, JobState, JobSummary
from runner.sandbox.fake import FakeSandboxes, prints, waits
from tests.service.service_fakes import checkout_tar

SPEC = JobSpec(repository="octo/hello", sha="a" * 40, command="ok", job_name="test", artifacts=("out/*",))


def test_answers_are_the_contracts_types(api, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"hello\n", exit_code=3)
    _, client = api()
    health = client.health()
    assert isinstance(health, Health) and health.ok is True and health.running == 0
    job = client.submit(SPEC)
    assert job == JobSummary(job.id, JobState.AWAITING_CHECKOUT)
    assert client.upload_checkout(job.id, checkout_tar()).state is JobState.QUEUED
    assert b"".join(e.data for e in client.logs(job.id) if e.stream == "stdout") == b"hello\n"
    record = client.get(job.id)
    assert isinstance(record, JobRecord)
    assert (record.state, record.exit_code, record.repository, record.job_name) == (
        JobState.FINISHED, 3, "octo/hello", "test")
    assert record.timings.finished_at is not None
    assert client.list(limit=5) == [record]
    assert client.cancel(job.id) == record  # already final: cancel answers the record as it is


def test_a_refusal_carries_the_status_and_the_services_message(api) -> None:
    _, client = api()
    with pytest.raises(JobAPIError, match=r"POST /v1/jobs: 400 invalid job: sha: expected a lowercase hex commit id") as err:
        client.submit(JobSpec(repository="octo/hello", sha="HEAD", command="true"))
    assert (err.value.status, err.value.retry_after, err.value.timed_out) == (400, None, False)


def test_a_full_queue_says_when_to_come_back(api, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs["block"] = waits(release)
    _, client = api(max_queued_jobs=1)
    client.submit(SPEC)
    with pytest.raises(JobAPIError, match="POST /v1/jobs: 429 ") as err:
        client.submit(SPEC)
    assert err.value.status == 429 and err.value.retry_after == 5
    release.set()


def test_logs_arrive_while_the_job_still_runs(api, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs["block"] = waits(release)
    _, client = api()
    job = client.submit(JobSpec(repository="octo/hello", sha="a" * 40, command="block")).id
    client.upload_checkout(job, checkout_tar())
    entries = client.logs(job)
    first = next(e for e in entries if e.stream == "stdout")
    assert first.data == b"started\n" and client.get(job).state is JobState.RUNNING
    release.set()
    list(entries)
    assert client.get(job).state is JobState.FINISHED


@contextmanager
def unix_server(path: Path, handle: Callable[[socket.socket], None]) -> Iterator[None]:
    """A server on a Unix socket that gives each connection it accepts to `handle`, one at a time."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                handle(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(10)


@contextmanager
def raw_service(path: Path, answer: Callable[[bytes], bytes]) -> Iterator[list[bytes]]:
    """A one-request-per-connection server on a Unix socket: records each request, sends `answer(request)`."""
    seen: list[bytes] = []

    def handle(conn: socket.socket) -> None:
        request = b""
        while b"\r\n\r\n" not in request or (b"chunked" in request and not request.endswith(b"0\r\n\r\n")):
            chunk = conn.recv(65536)
            if not chunk:
                break
            request += chunk
        seen.append(request)
        conn.sendall(answer(request))

    with unix_server(path, handle):
        yield seen


def json_answer(body: bytes) -> Callable[[bytes], bytes]:
    return lambda _request: (b"HTTP/1.1 202 Accepted\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(body), body))


def test_a_checkout_from_a_generator_is_sent_chunked_as_it_is_produced(short_dir: Path) -> None:
    pieces = [b"first-piece", b"second-piece"]
    with raw_service(short_dir / "s.sock", json_answer(b'{"id": "j1", "state": "queued"}')) as seen:
        with JobClient(socket=str(short_dir / "s.sock"), timeout=30) as client:
            answer = client.upload_checkout("j1", iter(pieces))
    head, _, body = seen[0].partition(b"\r\n\r\n")
    assert head.startswith(b"PUT /v1/jobs/j1/checkout HTTP/1.1") and b"Transfer-Encoding: chunked" in head
    assert chunks_of(body) == pieces  # one chunk per piece, as produced
    assert answer == JobSummary("j1", JobState.QUEUED)


def chunks_of(body: bytes) -> list[bytes]:
    """The chunks of a chunked body (sizes in hex, either case), its terminating chunk checked."""
    chunks = []
    while True:
        size, _, rest = body.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            assert rest == b"\r\n"
            return chunks
        assert rest[length:length + 2] == b"\r\n"
        chunks.append(rest[:length])
        body = rest[length + 2:]


def test_an_answer_of_the_wrong_shape_is_an_error_naming_the_field(short_dir: Path) -> None:
    with raw_service(short_dir / "s.sock", json_answer(b'{"id": 7, "state": "queued"}')):
        with JobClient(socket=str(short_dir / "s.sock"), timeout=30) as client:
            with pytest.raises(JobAPIError, match=r"PUT /v1/jobs/j1/checkout: the answer does not have the job "
                                                  r"API's shape: id: expected str, got int"):
                client.upload_checkout("j1", b"tar")


def test_an_oversized_answer_is_refused(short_dir: Path, monkeypatch) -> None:
    import runner.jobapi.client as client_mod

    monkeypatch.setattr(client_mod, "_MAX_JSON", 1000)
    body = b'{"ok": true, "accel": "' + b"x" * 2000 + b'", "running": 0, "queued": 0, "warm": 0}'
    with raw_service(short_dir / "s.sock", json_answer(body)):
        with JobClient(socket=str(short_dir / "s.sock"), timeout=30) as client:
            with pytest.raises(JobAPIError, match="GET /v1/health: the answer is larger than 1000 bytes"):
                client.health()


def test_a_job_id_cannot_change_the_path(short_dir: Path) -> None:
    with JobClient(socket=str(short_dir / "none.sock")) as client:
        with pytest.raises(JobAPIError, match=r"not a job id: '\.\./health'"):
            client.get("../health")
        with pytest.raises(JobAPIError, match="not a job id"):
            client.artifacts("j1?x=1", io.BytesIO())


def test_one_kept_connection_drives_a_job_and_the_log_ends_with_its_record(api, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"hello\n", exit_code=3)
    service, plain = api()
    plain.close()
    with JobClient(socket=service.config.socket, retry_statuses=frozenset(), keep_alive=True) as client:
        job = client.submit(SPEC).id
        client.upload_checkout(job, checkout_tar())
        ended: list[JobRecord] = []
        assert b"".join(e.data for e in client.logs(job, on_end=ended.append) if e.stream == "stdout") == b"hello\n"
        assert len(ended) == 1 and ended[0].final and ended[0].exit_code == 3
        assert ended[0] == client.get(job)  # what a get after the stream answers, without its round trip


def test_a_socket_nobody_serves_is_unreachable_and_a_refusal_is_not(api, tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as listener:  # bound, then closed: the file stays, nobody accepts
        listener.bind(str(stale))
    for where in (stale, tmp_path / "missing.sock"):
        with JobClient(socket=str(where)) as client, pytest.raises(JobAPIError) as err:
            client.submit(SPEC)
        assert err.value.unreachable and err.value.status is None, where
    _, client = api()
    with pytest.raises(JobAPIError) as refused:
        client.submit(JobSpec(repository="octo/hello", sha="HEAD", command="true"))
    assert refused.value.status == 400 and not refused.value.unreachable


def test_the_log_stream_opens_with_the_upload(api, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"hello\n", exit_code=3)
    _, client = api()
    job = client.submit(SPEC).id
    ended: list[JobRecord] = []
    out = b"".join(e.data for e in client.upload_and_follow(job, checkout_tar(), on_end=ended.append)
                   if e.stream == "stdout")
    assert out == b"hello\n" and ended and ended[0].exit_code == 3
    with pytest.raises(JobAPIError, match="409"):  # a refused upload raises as upload_checkout's does
        list(client.upload_and_follow(job, checkout_tar()))


HEALTH = b'{"ok": true, "accel": "tcg", "running": 0, "queued": 0, "warm": 0}'


@contextmanager
def kept_service(path: Path, drop: bool) -> Iterator[tuple[list[int], threading.Semaphore]]:
    """Answers each request of a connection with a health record, keeping the connection open; records one
    entry per connection accepted. With `drop` it closes each after its first answer without saying so (a
    kept connection gone stale), releasing the semaphore once closed."""
    accepted: list[int] = []
    closed = threading.Semaphore(0)
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(HEALTH), HEALTH)

    def handle(conn: socket.socket) -> None:
        accepted.append(1)
        pending = b""
        while chunk := conn.recv(65536):
            pending += chunk
            while b"\r\n\r\n" in pending:
                _, _, pending = pending.partition(b"\r\n\r\n")
                conn.sendall(answer)
                if drop:
                    conn.close()  # without a word: the client's kept connection is now stale
                    closed.release()
                    return

    with unix_server(path, handle):
        yield accepted, closed


@pytest.mark.parametrize(("keep_alive", "drop", "connections"), [
    (True, False, 1),  # `run`'s client: its requests share one connection
    (True, True, 3),  # the service closed the kept one: the next request opens another, nothing fails
    (False, False, 3),  # a plain client keeps nothing
])
def test_a_kept_connection_carries_the_next_request_unless_the_service_closed_it(
        short_dir: Path, keep_alive: bool, drop: bool, connections: int) -> None:
    with kept_service(short_dir / "k.sock", drop) as (accepted, closed):
        with JobClient(socket=str(short_dir / "k.sock"), timeout=30, keep_alive=keep_alive) as client:
            for _ in range(3):
                assert client.health().ok is True
                if drop:
                    assert closed.acquire(timeout=10)
    assert len(accepted) == connections


def test_the_client_and_run_load_no_httpx() -> None:
    """The client is http.client's (runner/jobapi/http1.py): httpx's import cost ~50 ms of every `run`."""
    import subprocess
    import sys

    probe = "import sys, runner.jobapi.client, runner.commands.localrun; print('httpx' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60, check=True)
    assert done.stdout.strip() == b"False"
