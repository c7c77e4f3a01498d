"""A client for the job API (docs/job-api.md), used by the action and by `microvm-check run`.

It speaks HTTP/1.1 over the service's Unix socket or TCP (http.client, pooled by runner.jobapi.http1),
streams bodies both ways (a checkout is sent chunked from a generator, logs and artifacts are read
as they arrive), and applies one explicit timeout to connecting, each read, each write and waiting
for a pooled connection. Answers come back as the contract's types (runner.jobapi.contract), and
every failure as a JobAPIError a user can act on: what was asked, the status, the service's own
message, and Retry-After when the service gave one.

A busy service (503) or a full queue (429) is waited out as the answer asks: the request is sent again
after its Retry-After plus jitter (so clients refused together do not return together), up to the
job's own deadline (its timeout_seconds from the submit) or `retry_seconds` for requests of no job,
with one progress line through `say` when the waiting starts. A streamed checkout is replayed from
its first REPLAY_BYTES, kept while it is sent; one refused after more than that is not retried.
"""

from __future__ import annotations

import builtins
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO, Protocol, TypeVar
from urllib.parse import SplitResult, urlsplit

from runner.errors import ClientError
from runner.jobapi import http1
from runner.jobapi.contract import (
    DEFAULT_SOCKET,
    JOB_TOKEN_HEADER,
    RUNNER_TOKEN_HEADER,
    SESSION_TOKEN_HEADER,
    Health,
    JobRecord,
    JobSpec,
    JobStarted,
    JobSummary,
    LogEntry,
    QueueFullAnswer,
    Verdict,
    WireError,
)

_CHUNK = 1024 * 1024
_MAX_LINE = 4 * 1024 * 1024  # one log entry, base64: far above the service's entry size
_MAX_JSON = 16 * 1024 * 1024  # a whole answer (a list of 1000 records)
_MAX_ERROR = 64 * 1024  # an error answer: {"error": "..."}
# A log follower holds one connection for as long as the job runs, and callers may follow several
# jobs at once; beyond this many a request waits (up to the timeout) for a free one. By default no
# connection is kept alive after its answer: a client that is never closed then leaves no socket open
# (the service also drops idle ones after 5 s). A client that drives one job from submit to its
# attestation (`run`, the action) keeps its one connection instead (`keep_alive`): no connect per request.
_MAX_CONNECTIONS, _KEEP_ALIVE_SECONDS = 16, 4.0
RETRY_STATUSES = frozenset({429, 503})
REPLAY_BYTES = 8 * 1024 * 1024  # of a streamed body, kept so that a refused upload can be sent again
MIN_RETRY_WAIT, MAX_RETRY_WAIT, DEFAULT_RETRY_WAIT = 0.5, 30.0, 5.0  # seconds
DEFAULT_JOB_SECONDS = 3600  # a job's deadline when its spec leaves timeout_seconds to the service
_JOB_PATH = re.compile(r"/v1/jobs/([A-Za-z0-9_-]+)")

T = TypeVar("T")


class ByteSink(Protocol):
    """Where `JobClient.artifacts` writes: a binary file, or a wrapper that bounds one."""

    def write(self, data: bytes, /) -> object: ...


class JobAPIError(ClientError):
    """The service refused a request or could not be reached.

    `status` is the HTTP status (None when the service was not reached or its answer broke off),
    `retry_after` the seconds the service asked the client to wait (429, 503), `queued` how many jobs
    waited ahead when a submit found the queue full (429; None when the service did not say), and
    `timed_out` says that the service stopped answering within the client's timeout (for a log stream:
    the job is silent, not necessarily gone), `unreachable` that no connection could be made (so nothing
    of the request was sent: no service is there, a caller may fall back to another).
    """

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None,
                 timed_out: bool = False, queued: int | None = None, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.timed_out = timed_out
        self.queued = queued
        self.unreachable = unreachable


class JobClient:
    """One service, reached over `socket` (default DEFAULT_SOCKET) or `url` (http://HOST:PORT with a `token`).

    `runner_token` is a fleet runner's credential (MICROVM_CHECK_RUNNER_TOKEN), sent with every request.
    The job token a submit answers is kept and sent with that job's later requests; `job_tokens`
    holds them (add one to reach a job this client did not submit). `session_token` is a `keep: job`
    session's token: sent with each submit, and set from a submit that opened a session. Keeps a small pool of
    connections; close it with `close()` or use the client as a context manager.
    """

    def __init__(self, socket: str | None = None, url: str | None = None, token: str | None = None,
                 timeout: float | None = 60.0, runner_token: str | None = None, retry_seconds: float = 60.0,
                 say: Callable[[str], None] | None = None, retry_statuses: frozenset[int] = RETRY_STATUSES,
                 keep_alive: bool = False) -> None:
        if socket is not None and url is not None:
            raise ValueError("give at most one of socket or url")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if runner_token:
            headers[RUNNER_TOKEN_HEADER] = runner_token
        self.job_tokens: dict[str, str] = {}
        self.retry_seconds = retry_seconds
        self.say = say or _stderr_line
        self.retry_statuses = retry_statuses  # the action waits out a full queue (429) itself: action/queuewait.py
        self._deadlines: dict[str, float] = {}  # job id -> monotonic time its retries end
        self._sleep: Callable[[float], None] = time.sleep
        self.session_token: str | None = None
        self._headers = headers
        where: str | SplitResult
        if url is None:
            self.where = where = socket or DEFAULT_SOCKET
        else:
            where = urlsplit(url)
            if where.scheme not in ("http", "https") or not where.hostname:
                raise ValueError(f"url: expected http(s)://HOST:PORT, got {url!r}")
            self.where = url
        self._http = http1.Pool(where, timeout, max_connections=_MAX_CONNECTIONS, keep=1 if keep_alive else 0,
                                expiry=_KEEP_ALIVE_SECONDS)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the API ----------------------------------------------------------------------------------

    def health(self) -> Health:
        return self._call("GET", "/v1/health", Health.from_wire)

    def submit(self, spec: JobSpec | Mapping[str, object]) -> JobSummary:
        """Submit a job; a mapping is sent as it is (the wire form, e.g. to test the service's checks)."""
        body = spec.to_wire() if isinstance(spec, JobSpec) else dict(spec)
        headers = {"Content-Type": "application/json"}
        if self.session_token:
            headers[SESSION_TOKEN_HEADER] = self.session_token
        seconds = (spec.timeout_seconds if isinstance(spec, JobSpec) else None) or DEFAULT_JOB_SECONDS
        deadline = time.monotonic() + seconds
        summary = self._call("POST", "/v1/jobs", JobSummary.from_wire, content=json.dumps(body).encode(),
                             headers=headers, deadline=deadline)
        self._deadlines[summary.id] = deadline
        if summary.token:
            self.job_tokens[summary.id] = summary.token
        if summary.session_token:
            self.session_token = summary.session_token
        return summary

    def upload_checkout(self, job_id: str, data: BinaryIO | Iterable[bytes] | bytes) -> JobSummary:
        """Send the checkout tar: bytes as they are, a file or an iterable of chunks streamed (chunked)."""
        body = bytes(data) if isinstance(data, (bytes, bytearray)) else _Replayable(_chunks(data))
        return self._call("PUT", f"/v1/jobs/{_id(job_id)}/checkout", JobSummary.from_wire, content=body,
                          headers={"Content-Type": "application/x-tar", **self._job(job_id)})

    def upload_and_follow(self, job_id: str, data: BinaryIO | Iterable[bytes] | bytes,
                          on_end: Callable[[JobRecord], object] | None = None) -> Iterator[LogEntry]:
        """Send the checkout and follow the job's log in the same request's answer (`PUT .../checkout?follow=1`):
        the stream is open once the upload is in, with no request of its own.

        The upload is sent now, before this returns: a refused one raises here, as `upload_checkout` does, so a
        caller can tell a checkout that never landed from a log stream that broke afterwards. The returned
        iterator reads the log (iterate it to its end: that closes the answer); a stream that breaks is resumed
        as `logs` resumes one, and a service that answers the upload 202 (one older than `follow`) is followed
        with `logs`."""
        body = bytes(data) if isinstance(data, (bytes, bytearray)) else _Replayable(_chunks(data))
        method, path = "PUT", f"/v1/jobs/{_id(job_id)}/checkout?follow=1"
        resp = self._open(method, path, content=body, headers={"Content-Type": "application/x-tar", **self._job(job_id)})
        if resp.status_code != 200:
            resp.close()
            return self.logs(job_id, on_end=on_end)
        return self._follow_answer(job_id, resp, method, path, on_end)

    def _follow_answer(self, job_id: str, resp: http1.Response, method: str, path: str,
                       on_end: Callable[[JobRecord], object] | None) -> Iterator[LogEntry]:
        """The log entries of an upload's answer; past a break, the rest through `logs`."""
        after = 0
        try:
            for entry in _entries(resp, method, path, on_end):
                after = entry.seq
                yield entry
            return
        except _StreamBroken:
            pass
        finally:
            resp.close()
        yield from self.logs(job_id, after=after, on_end=on_end)

    def get(self, job_id: str) -> JobRecord:
        return self._call("GET", f"/v1/jobs/{_id(job_id)}", JobRecord.from_wire, headers=self._job(job_id))

    def list(self, limit: int = 50) -> list[JobRecord]:
        return self._call("GET", f"/v1/jobs?limit={int(limit)}", _records)

    def status(self) -> dict[str, Any]:
        """GET /v1/status (operators): the host's VMs, spare pools, queue, recent jobs and runners."""
        return self._call("GET", "/v1/status", _status)

    def cancel(self, job_id: str) -> JobRecord:
        return self._call("POST", f"/v1/jobs/{_id(job_id)}/cancel", JobRecord.from_wire,
                          headers=self._job(job_id))

    def job_started(self, job: JobStarted) -> Verdict:
        """A fleet runner's job-started hook: report the job; the service answers whether it may run."""
        body = json.dumps(job.to_wire()).encode()
        return self._call("POST", "/v1/runner/job-started", Verdict.from_wire, content=body,
                          headers={"Content-Type": "application/json"})

    def job_completed(self) -> builtins.list[str]:  # `list` in this class is the method above
        """A fleet runner's job-completed hook: the service cancels what this runner's job still runs;
        answers the ids of the jobs it cancelled."""
        return self._call("POST", "/v1/runner/job-completed", _cancelled)

    def logs(self, job_id: str, after: int = 0, reconnects: int = 3, follow: bool = True,
             on_end: Callable[[JobRecord], object] | None = None) -> Iterator[LogEntry]:
        """Follow a job's log live; ends when the job has ended (with `follow=False`: at the log's end now).
        A dropped connection resumes after the last seq. `on_end` is given the job's record the stream's
        end line carries (what a `get` right after would answer, without its round trip)."""
        while True:
            try:
                for entry in self._log_stream(job_id, after, follow, on_end):
                    after = entry.seq
                    yield entry
                return
            except _StreamBroken as exc:
                if reconnects <= 0:
                    raise JobAPIError(f"the log stream of job {job_id} broke repeatedly: {exc}",
                                      timed_out=exc.timed_out) from exc
                reconnects -= 1

    def artifacts(self, job_id: str, out: ByteSink) -> int:
        """Write the job's artifact tar to `out`; returns the bytes written."""
        method, path = "GET", f"/v1/jobs/{_id(job_id)}/artifacts"
        resp = self._open(method, path, headers=self._job(job_id))
        written = 0
        try:
            for chunk in resp.iter_bytes(_CHUNK):
                out.write(chunk)
                written += len(chunk)
        except http1.TransportError as exc:
            raise _broken(method, path, exc) from exc
        finally:
            resp.close()
        return written

    def attestation(self, job_id: str) -> bytes:
        """The job's signed record, a DSSE envelope line (runner/attest/), once the job has ended."""
        return self._bytes("GET", f"/v1/jobs/{_id(job_id)}/attestation", headers=self._job(job_id))

    def attestation_key(self) -> str:
        """The PEM public key the service signs job records with."""
        return self._bytes("GET", "/v1/attestation-key").decode("ascii", "replace")

    # -- plumbing ---------------------------------------------------------------------------------

    def _bytes(self, method: str, path: str, **kwargs: Any) -> bytes:
        resp = self._open(method, path, **kwargs)
        try:
            return _read(resp, _MAX_JSON, method, path)
        finally:
            resp.close()

    def _call(self, method: str, path: str, parse: Callable[[object], T], **kwargs: Any) -> T:
        resp = self._open(method, path, **kwargs)
        try:
            data = _read(resp, _MAX_JSON, method, path)
        finally:
            resp.close()
        try:
            return parse(json.loads(data))
        except (ValueError, WireError) as exc:  # json's errors, and an answer without the contract's shape
            what = "does not have the job API's shape" if isinstance(exc, WireError) else "is not JSON"
            raise JobAPIError(f"{method} {path}: the answer {what}: {exc}") from exc

    def _open(self, method: str, path: str, deadline: float | None = None, content: http1.Body = None,
              headers: Mapping[str, str] | None = None) -> http1.Response:
        """The streamed answer, its status checked: >= 400 and transport trouble become a JobAPIError;
        429 and 503 are sent again as the service asks, until `deadline` (default: the job's). The caller
        closes it."""
        waiting = False
        sent = {**self._headers, **(headers or {})}
        while True:
            try:
                resp = self._http.send(method, path, sent, content)
            except http1.TransportError as exc:
                raise JobAPIError(f"cannot reach the job service at {self.where}: {_reason(exc)}",
                                  timed_out=isinstance(exc, http1.Timeout),
                                  unreachable=isinstance(exc, http1.ConnectError)) from exc
            if resp.status_code < 400:
                return resp
            try:
                error = _api_error(method, path, resp)
            finally:
                resp.close()
            if deadline is None:
                deadline = self._deadline(path)
            delay = retry_delay(error.retry_after)
            if (error.status not in self.retry_statuses or error.retry_after is None  # not asked to come back
                    or time.monotonic() + delay > deadline
                    or (isinstance(content, _Replayable) and not content.rewind())):
                raise error
            if not waiting:
                waiting = True
                self.say(f"microvm-check: {error}; retrying as the service asks, for up to "
                         f"{deadline - time.monotonic():.0f} s")
            self._sleep(delay)

    def _deadline(self, path: str) -> float:
        """When retries of a request end: its job's deadline, or `retry_seconds` from now."""
        match = _JOB_PATH.match(path)
        job = self._deadlines.get(match.group(1)) if match else None
        return job if job is not None else time.monotonic() + self.retry_seconds

    def _job(self, job_id: str) -> dict[str, str]:
        """The job's own token as a header, when this client has it."""
        token = self.job_tokens.get(job_id)
        return {JOB_TOKEN_HEADER: token} if token else {}

    def _log_stream(self, job_id: str, after: int, follow: bool = True,
                    on_end: Callable[[JobRecord], object] | None = None) -> Iterator[LogEntry]:
        method, path = "GET", f"/v1/jobs/{_id(job_id)}/logs?after={int(after)}" + ("" if follow else "&follow=0")
        try:
            resp = self._open(method, path, headers=self._job(job_id))
        except JobAPIError as exc:
            if exc.status is None:
                raise _StreamBroken(str(exc), exc.timed_out) from exc
            raise
        try:
            yield from _entries(resp, method, path, on_end)
        finally:
            resp.close()


class _StreamBroken(ClientError):
    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def retry_delay(retry_after: float | None, uniform: Callable[[float, float], float] = random.uniform) -> float:
    """The service's Retry-After (bounded) plus up to half of it again at random."""
    asked = min(max(DEFAULT_RETRY_WAIT if retry_after is None else retry_after, MIN_RETRY_WAIT), MAX_RETRY_WAIT)
    return asked + uniform(0, asked / 2)


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Replayable:
    """A streamed body that can be sent again from its start while it has sent at most REPLAY_BYTES."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._kept: list[bytes] = []
        self._kept_bytes = 0
        self._overflowed = False

    def __iter__(self) -> Iterator[bytes]:
        yield from list(self._kept)
        for chunk in self._chunks:
            self._kept_bytes += len(chunk)
            if self._kept_bytes <= REPLAY_BYTES:
                self._kept.append(chunk)
            else:
                self._overflowed = True
            yield chunk

    def rewind(self) -> bool:
        """Whether it can be sent again from its first chunk: not once more was sent than was kept."""
        return not self._overflowed


def _reason(exc: http1.TransportError) -> str:
    """The transport's message, or its class name when it has none."""
    return str(exc) or type(exc).__name__


def _broken(method: str, path: str, exc: http1.TransportError) -> JobAPIError:
    return JobAPIError(f"{method} {path}: the answer broke off: {_reason(exc)}",
                       timed_out=isinstance(exc, http1.Timeout))


def _read(resp: http1.Response, limit: int, method: str, path: str) -> bytes:
    data = bytearray()
    try:
        for chunk in resp.iter_bytes():
            data += chunk
            if len(data) > limit:
                raise JobAPIError(f"{method} {path}: the answer is larger than {limit} bytes")
    except http1.TransportError as exc:
        raise _broken(method, path, exc) from exc
    return bytes(data)


def _entries(resp: http1.Response, method: str, path: str,
             on_end: Callable[[JobRecord], object] | None) -> Iterator[LogEntry]:
    """The log entries of a streamed answer, until its end line (whose record goes to `on_end`)."""
    for line in _lines(resp, method, path):
        if not line.strip():
            continue  # the service's heartbeat on a silent stream (docs/job-api.md)
        try:
            obj = json.loads(line)
            if isinstance(obj, dict) and obj.get("end"):
                if on_end is not None and "job" in obj:
                    on_end(JobRecord.from_wire(obj["job"]))
                return
            entry = LogEntry.from_wire(obj)
        except (ValueError, WireError) as exc:
            raise JobAPIError(f"{method} {path}: a log line is not a log entry: {exc}") from exc
        yield entry


def _lines(resp: http1.Response, method: str, path: str) -> Iterator[bytes]:
    """Whole NDJSON lines as they arrive (each at most _MAX_LINE); a cut or overlong line breaks the stream."""
    pending = bytearray()
    try:
        for chunk in resp.iter_bytes():
            pending += chunk
            while (end := pending.find(b"\n")) >= 0:
                yield bytes(pending[:end])
                del pending[:end + 1]
            if len(pending) > _MAX_LINE:
                raise _StreamBroken(f"{method} {path}: a log line is longer than {_MAX_LINE} bytes", False)
    except http1.TransportError as exc:
        raise _StreamBroken(f"{method} {path}: {_reason(exc)}", isinstance(exc, http1.Timeout)) from exc
    raise _StreamBroken(f"{method} {path}: the stream ended before the job did", False)


def _api_error(method: str, path: str, resp: http1.Response) -> JobAPIError:
    try:
        body = json.loads(_read(resp, _MAX_ERROR, method, path))
    except (ValueError, JobAPIError):
        body = None
    message = body.get("error") if isinstance(body, dict) else None
    retry = resp.headers.get("Retry-After", "")
    return JobAPIError(
        f"{method} {path}: {resp.status_code} {message or resp.reason_phrase}",
        status=resp.status_code,
        # delta-seconds only (an HTTP date is not worth a clock comparison here); ASCII: "²".isdigit() too
        retry_after=float(retry) if retry.isascii() and retry.isdigit() else None,
        queued=_queued(body) if resp.status_code == 429 else None,
    )


def _queued(body: object) -> int | None:
    """The queue depth of a 429 answer (contract.QueueFullAnswer), or None from a service that does not send it."""
    try:
        return QueueFullAnswer.from_wire(body).queued
    except WireError:
        return None


def _cancelled(data: object) -> list[str]:
    ids = data.get("cancelled") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise WireError("cancelled: expected a list of job ids")
    return ids


def _status(data: object) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise WireError("status: expected a JSON object")
    return data


def _records(data: object) -> list[JobRecord]:
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list):
        raise WireError("jobs: expected a list of job records")
    return [JobRecord.from_wire(item) for item in jobs]


def _chunks(data: BinaryIO | Iterable[bytes]) -> Iterator[bytes]:
    read = getattr(data, "read", None)
    if read is None:
        yield from (bytes(chunk) for chunk in data if chunk)
        return
    while chunk := read(_CHUNK):
        yield chunk


def _id(job_id: str) -> str:
    """Keeps the path what it says: which ids exist is the service's answer (404), not the client's guess."""
    if not job_id or not all(c.isalnum() or c in "-_" for c in job_id):
        raise JobAPIError(f"not a job id: {job_id[:40]!r}")
    return job_id
