"""The jobs' routes on the job API (docs/job-api.md): submit and list under /v1/jobs, and a job's own
under /v1/jobs/<id>: its record, checkout upload (with `follow=1`, its log stream in the same answer),
log stream, artifacts, attestation and cancel. Each job's route needs the job's own token or the operator."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from runner.httpserve import parse_decimal
from runner.jobapi.contract import (
    JOB_TOKEN_HEADER,
    LIST_DEFAULT,
    LIST_MAX,
    MAX_LOG_SEQ,
    SESSION_TOKEN_HEADER,
    JobSummary,
)
from runner.service.api.attach import attach
from runner.service.api.refusals import BadRequest, MethodNotAllowed
from runner.service.jobs.auth import Caller
from runner.service.jobs.joblog import LogCursor

if TYPE_CHECKING:
    from runner.service.api.exchange import Exchange

_CHUNK = 1024 * 1024
HEARTBEAT_SECONDS = 15.0  # an empty line on a silent log stream (docs/job-api.md)


def int_param(query: dict[str, list[str]], name: str, default: int, low: int, high: int) -> int:
    values = query.get(name)
    if not values:
        return default
    value = parse_decimal(values[-1], max_digits=len(str(high)))
    if value is None or not low <= value <= high:
        raise BadRequest(f"query parameter {name}: expected an integer between {low} and {high}, "
                         f"got {values[-1][:40]!r}")
    return value


def collection(ex: Exchange, params: Mapping[str, str]) -> None:
    """/v1/jobs (runner/service/api/paths.py)."""
    JobRoutes(ex).collection(ex.caller())


def job(ex: Exchange, params: Mapping[str, str]) -> None:
    """/v1/jobs/<id> and its calls (runner/service/api/paths.py)."""
    JobRoutes(ex).answer(params["id"], params["rest"], ex.caller())


class JobRoutes:
    """Answers one request on a job route."""

    def __init__(self, exchange: Exchange) -> None:
        self.h = exchange

    def collection(self, caller: Caller) -> None:
        """POST /v1/jobs submits a spec; GET lists the jobs (the operator's)."""
        h, method = self.h, self.h.method
        if method == "POST":
            record, token, session_token = h.service.submit_as(caller, h.json_body(),
                                                               h.headers.get(SESSION_TOKEN_HEADER))
            return h.send_json(201, JobSummary(record.id, record.state, token, session_token).to_wire())
        h.service.access.require_operator(caller, "listing all jobs")
        limit = int_param(h.query, "limit", LIST_DEFAULT, 1, LIST_MAX)
        h.send_json(200, {"jobs": [r.to_wire() for r in h.service.list(limit)]})

    def answer(self, job_id: str, rest: str, caller: Caller) -> None:
        h, method, query = self.h, self.h.method, self.h.query
        if (method, rest) == ("GET", "/terminal"):  # never with the job's token: the operator's, or attach_group's
            return attach(h, lambda: h.service.run_of(job_id), caller, h.service.config.attach_group)
        handler = {
            ("GET", ""): lambda: h.send_json(200, h.service.get(job_id).to_wire()),
            ("PUT", "/checkout"): lambda: self.checkout(job_id, follow=int_param(query, "follow", 0, 0, 1) == 1),
            ("GET", "/logs"): lambda: self.logs(job_id, int_param(query, "after", 0, 0, MAX_LOG_SEQ),
                                                follow=int_param(query, "follow", 1, 0, 1) == 1),
            ("GET", "/artifacts"): lambda: self.artifacts(job_id),
            ("GET", "/attestation"): lambda: h.respond(200, h.service.attestation(job_id),
                                                       {"Content-Type": "application/vnd.in-toto+json"}),
            ("POST", "/cancel"): lambda: h.send_json(202, h.service.cancel(job_id).to_wire()),
        }.get((method, rest))
        if handler is None:
            raise MethodNotAllowed(f"{method} is not allowed on {h.path}")
        h.service.access.require_job(caller, job_id, h.headers.get(JOB_TOKEN_HEADER))
        handler()

    def checkout(self, job_id: str, follow: bool = False) -> None:
        """202 and the job's summary; with `follow=1` the job's log stream instead, as GET .../logs answers it:
        a client that uploads and then follows (run, the action) needs no request of its own for the stream."""
        record = self.h.service.put_checkout(job_id, self.h.body())
        if follow:
            return self.logs(job_id, 0)
        self.h.send_json(202, JobSummary(record.id, record.state).to_wire())

    def logs(self, job_id: str, after: int, follow: bool = True) -> None:
        """The log from seq `after` on, live until the job ends (`follow=0`: what is written so far)."""
        # chunked (close-delimited to HTTP/1.0), copied by the listener's stream thread: a client following
        # a queued job's log holds no worker
        stream = LogStream(self.h.service.log_of(job_id).cursor(after, wait=follow), lambda: self.end_line(job_id))
        self.h.start_response(200, {"Content-Type": "application/x-ndjson"})
        self.h.hand_off(stream)

    def end_line(self, job_id: str) -> bytes:
        return json.dumps({"end": True, "job": self.h.service.get(job_id).to_wire()}).encode() + b"\n"

    def artifacts(self, job_id: str, headers: dict[str, str] | None = None) -> None:
        h = self.h
        path = h.service.artifacts_path(job_id)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.start_response(200, {"Content-Type": "application/x-tar", "Content-Length": str(size),
                                   **(headers or {})})
            left = size
            while left:
                data = f.read(min(left, _CHUNK))
                if not data:
                    raise OSError(f"{path} shrank while being sent")
                h.send_data(data)
                left -= len(data)
            h.end_response()


class LogStream:
    """A job's log as the stream thread reads it (runner.httpserve.Stream): the lines committed so far,
    then the end line once the log is closed. A silent job gets an empty line every HEARTBEAT_SECONDS, so
    a client's read timeout tells a live but quiet stream (a job waiting in the queue) from a dead one."""

    def __init__(self, cursor: LogCursor, end: Callable[[], bytes], transform: Callable[[bytes], bytes] | None = None,
                 heartbeat: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self._cursor, self._end, self._transform, self._clock = cursor, end, transform, clock
        self._heartbeat = heartbeat
        self._last = clock()

    def watch(self, wake: Callable[[], None]) -> None:
        self._cursor.watch(wake)

    def unwatch(self, wake: Callable[[], None]) -> None:
        self._cursor.unwatch(wake)

    def read(self) -> tuple[bytes, bool]:
        lines, ended = self._cursor.read()
        now = self._clock()
        if lines:
            self._last = now
            transform = self._transform
            return b"".join(transform(line) for line in lines) if transform else b"".join(lines), False
        if ended:
            return self._end(), True
        if self._heartbeat and now - self._last >= HEARTBEAT_SECONDS:
            self._last = now
            return b"\n", False
        return b"", False
