"""JobDriver's log following (action/__main__.py) against fake clients and a silent real socket."""

from __future__ import annotations

import io
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import action.__main__ as main_mod
from action.__main__ import LOG_RETRIES, JobDriver, _is_timeout
from action.inputs import Inputs
from runner.errors import UserError
from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import JobRecord, JobState, LogEntry
from tests.action.job_records import job_record


def _inputs() -> Inputs:
    return Inputs(run="make check", working_directory=".", policy="", artifacts=[], timeout_minutes=10,
                  template="base", env_names=[], socket="/nonexistent", include_git=False)


def _timeout_error() -> JobAPIError:
    """A JobAPIError as the real client raises it after a read timeout (see test below)."""
    return JobAPIError("the log stream of job j1 broke repeatedly: ReadTimeout", timed_out=True)


class FakeClient:
    """Each logs() call is one round: yields `per_round` entries, then fails with `error()`."""

    def __init__(self, rounds: int, per_round: int, error) -> None:
        self.rounds, self.per_round, self.error = rounds, per_round, error
        self.calls, self.seq, self.cancelled = 0, 0, False

    def logs(self, job_id: str, after: int = 0, on_end: object = None) -> Iterator[LogEntry]:
        # ends without the record (as a stream that broke off): the driver asks get() whether the job is over
        assert after == self.seq, "resumes after the last seq seen"
        self.calls += 1
        for _ in range(self.per_round):
            self.seq += 1
            yield LogEntry(self.seq, "stdout", 0.0, b"line %d\n" % self.seq)
        if self.calls <= self.rounds:
            raise self.error()

    def get(self, job_id: str) -> JobRecord:
        state = JobState.FINISHED if self.calls > self.rounds else JobState.RUNNING
        return JobRecord(id=job_id, state=state, repository="o/r", sha="0" * 40, run_id=None, run_attempt=None,
                         job_name="")


def _relay(client: FakeClient, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setattr(main_mod.time, "sleep", lambda _s: None)
    out = io.StringIO()
    run = JobDriver(client, _inputs(), Path("."), out, {})
    run.job_id = "j1"
    dropped, _record = run._relay_logs(None)
    return dropped, out.getvalue()


def test_the_uploads_own_stream_is_relayed_and_a_break_resumed_after_its_last_seq(monkeypatch):
    """The log comes first on the upload's answer (PUT .../checkout?follow=1); when that breaks off, the
    driver follows with logs() from the last seq the upload's stream brought, and shows both."""
    monkeypatch.setattr(main_mod.time, "sleep", lambda _s: None)
    client = FakeClient(rounds=0, per_round=1, error=lambda: None)
    client.seq = 2

    def upload_answer() -> Iterator[LogEntry]:
        yield LogEntry(1, "stdout", 0.0, b"upload line 1\n")
        yield LogEntry(2, "stdout", 0.0, b"upload line 2\n")
        raise JobAPIError("connection reset")

    out = io.StringIO()
    run = JobDriver(client, _inputs(), Path("."), out, {})
    run.job_id = "j1"
    run._relay_logs(upload_answer())
    assert client.calls == 1  # one logs() request, after seq 2 (FakeClient checks `after`)
    text = out.getvalue()
    assert text.index("upload line 1") < text.index("upload line 2") < text.index("line 3")


def test_a_stream_that_keeps_making_progress_is_never_given_up(monkeypatch):
    # Every reconnect brings new entries: a long job on a flaky connection, not a lost stream.
    client = FakeClient(rounds=LOG_RETRIES * 4, per_round=2, error=lambda: JobAPIError("connection reset"))
    dropped, out = _relay(client, monkeypatch)
    assert dropped == 0
    assert client.calls == LOG_RETRIES * 4 + 1
    assert f"line {client.seq}" in out


def test_read_timeouts_of_a_silent_running_job_are_not_failures(monkeypatch):
    # A job that prints nothing for a long time: every follow times out, the job is still running.
    client = FakeClient(rounds=LOG_RETRIES * 4, per_round=0, error=_timeout_error)
    assert _relay(client, monkeypatch)[0] == 0
    assert client.calls == LOG_RETRIES * 4 + 1


def test_a_stream_that_fails_without_progress_is_still_given_up(monkeypatch):
    client = FakeClient(rounds=10**6, per_round=0, error=lambda: JobAPIError("cannot reach the job service"))
    with pytest.raises(UserError, match="lost the log stream of job j1: cannot reach"):
        _relay(client, monkeypatch)
    assert client.calls == LOG_RETRIES + 1


def test_the_real_client_reports_a_silent_stream_as_a_timeout(tmp_path):
    """_is_timeout must recognise what JobClient.logs raises when a running job prints nothing."""
    path = str(tmp_path / "api.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            conns.append(conn)  # then silence, like a job that prints nothing

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        client = JobClient(socket=path, timeout=0.2)
        with pytest.raises(JobAPIError) as info:
            list(client.logs("j1"))
        assert _is_timeout(info.value)
        assert not _is_timeout(JobAPIError("cannot reach the job service"))
    finally:
        stop.set()
        thread.join()
        for conn in conns:
            conn.close()
        server.close()


@pytest.mark.parametrize(("timeout", "said"), [(1, "after 1 minute"), (0.5, "after 0.5 minutes"),
                                               (10, "after 10 minutes")])
def test_a_timed_out_job_says_minute_or_minutes(timeout: float, said: str) -> None:
    """Before: "job timed out after 1 minutes"."""
    from dataclasses import replace

    from action.summary import Result

    out = io.StringIO()
    run = JobDriver(FakeClient(0, 0, lambda: None), replace(_inputs(), timeout_minutes=timeout), Path("."), out, {})
    record = {"id": "j1", "state": "timed_out", "exit_code": None}
    run._report(Result(job_record(record), 124, None, [], []))
    assert out.getvalue() == f"::error::job timed out {said}\n"
