"""A client for the job API (docs/job-api.md), used by the action and by `microvm-check run`.

Built on httpx: it speaks HTTP/1.1 over the service's Unix socket (`HTTPTransport(uds=...)`) or TCP,
streams bodies both ways (a checkout is sent chunked from a generator, logs and artifacts are read
as they arrive), and applies one explicit timeout to connecting, each read, each write and waiting
for a pooled connection. Answers come back as the contract's types (runner.jobapi.contract), and
every failure as a JobAPIError a user can act on: what was asked, the status, the service's own
message, and Retry-After when the service gave one.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO, Protocol, TypeVar
from urllib.parse import urlsplit

import httpx

from runner.errors import ClientError
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
# jobs at once; beyond this many a request waits (up to the timeout) for a free one. No connection is
# kept alive after its answer: over a local socket a new one costs little, and a client that is never
# closed then leaves no socket open (the service also drops idle ones after 5 s).
_POOL = httpx.Limits(max_connections=16, max_keepalive_connections=0)

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
    the job is silent, not necessarily gone).
    """

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None,
                 timed_out: bool = False, queued: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.timed_out = timed_out
        self.queued = queued


class JobClient:
    """One service, reached over `socket` (default DEFAULT_SOCKET) or `url` (http://HOST:PORT with a `token`).

    `runner_token` is a fleet runner's credential (MICROVM_CHECK_RUNNER_TOKEN), sent with every request.
    The job token a submit answers is kept and sent with that job's later requests; `job_tokens`
    holds them (add one to reach a job this client did not submit). `session_token` is a `keep: job`
    session's token: sent with each submit, and set from a submit that opened a session. Keeps a small pool of
    connections; close it with `close()` or use the client as a context manager.
    """

    def __init__(self, socket: str | None = None, url: str | None = None, token: str | None = None,
                 timeout: float | None = 60.0, runner_token: str | None = None) -> None:
        if socket is not None and url is not None:
            raise ValueError("give at most one of socket or url")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if runner_token:
            headers[RUNNER_TOKEN_HEADER] = runner_token
        self.job_tokens: dict[str, str] = {}
        self.session_token: str | None = None
        if url is None:
            self.where = socket or DEFAULT_SOCKET
            transport = httpx.HTTPTransport(uds=self.where, limits=_POOL)
            base = "http://localhost"
        else:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"url: expected http(s)://HOST:PORT, got {url!r}")
            self.where, base = url, url
            transport = httpx.HTTPTransport(limits=_POOL)
        self._http = httpx.Client(transport=transport, base_url=base, headers=headers,
                                  timeout=httpx.Timeout(timeout), follow_redirects=False)

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
        summary = self._call("POST", "/v1/jobs", JobSummary.from_wire, content=json.dumps(body).encode(),
                             headers=headers)
        if summary.token:
            self.job_tokens[summary.id] = summary.token
        if summary.session_token:
            self.session_token = summary.session_token
        return summary

    def upload_checkout(self, job_id: str, data: BinaryIO | Iterable[bytes] | bytes) -> JobSummary:
        """Send the checkout tar: bytes as they are, a file or an iterable of chunks streamed (chunked)."""
        body = bytes(data) if isinstance(data, (bytes, bytearray)) else _chunks(data)
        return self._call("PUT", f"/v1/jobs/{_id(job_id)}/checkout", JobSummary.from_wire, content=body,
                          headers={"Content-Type": "application/x-tar", **self._job(job_id)})

    def get(self, job_id: str) -> JobRecord:
        return self._call("GET", f"/v1/jobs/{_id(job_id)}", JobRecord.from_wire, headers=self._job(job_id))

    def list(self, limit: int = 50) -> list[JobRecord]:
        return self._call("GET", f"/v1/jobs?limit={int(limit)}", _records)

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

    def logs(self, job_id: str, after: int = 0, reconnects: int = 3) -> Iterator[LogEntry]:
        """Follow a job's log live; ends when the job has ended. A dropped connection resumes after the last seq."""
        while True:
            try:
                for entry in self._log_stream(job_id, after):
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
        except httpx.TransportError as exc:
            raise _broken(method, path, exc) from exc
        finally:
            resp.close()
        return written

    # -- plumbing ---------------------------------------------------------------------------------

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

    def _open(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The streamed answer, its status checked: >= 400 and transport trouble become a JobAPIError.
        The caller closes it."""
        request = self._http.build_request(method, path, **kwargs)
        try:
            resp = self._http.send(request, stream=True)
        except httpx.TransportError as exc:
            raise JobAPIError(f"cannot reach the job service at {self.where}: {_reason(exc)}",
                              timed_out=isinstance(exc, httpx.TimeoutException)) from exc
        if resp.status_code >= 400:
            try:
                raise _api_error(method, path, resp)
            finally:
                resp.close()
        return resp

    def _job(self, job_id: str) -> dict[str, str]:
        """The job's own token as a header, when this client has it."""
        token = self.job_tokens.get(job_id)
        return {JOB_TOKEN_HEADER: token} if token else {}

    def _log_stream(self, job_id: str, after: int) -> Iterator[LogEntry]:
        method, path = "GET", f"/v1/jobs/{_id(job_id)}/logs?after={int(after)}"
        try:
            resp = self._open(method, path, headers=self._job(job_id))
        except JobAPIError as exc:
            if exc.status is None:
                raise _StreamBroken(str(exc), exc.timed_out) from exc
            raise
        try:
            for line in _lines(resp, method, path):
                try:
                    obj = json.loads(line)
                    if isinstance(obj, dict) and obj.get("end"):
                        return
                    entry = LogEntry.from_wire(obj)
                except (ValueError, WireError) as exc:
                    raise JobAPIError(f"{method} {path}: a log line is not a log entry: {exc}") from exc
                yield entry
        finally:
            resp.close()


class _StreamBroken(ClientError):
    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _reason(exc: httpx.TransportError) -> str:
    """httpx's message, or its class name when it has none (a read timeout can come without one)."""
    return str(exc) or type(exc).__name__


def _broken(method: str, path: str, exc: httpx.TransportError) -> JobAPIError:
    return JobAPIError(f"{method} {path}: the answer broke off: {_reason(exc)}",
                       timed_out=isinstance(exc, httpx.TimeoutException))


def _read(resp: httpx.Response, limit: int, method: str, path: str) -> bytes:
    data = bytearray()
    try:
        for chunk in resp.iter_bytes():
            data += chunk
            if len(data) > limit:
                raise JobAPIError(f"{method} {path}: the answer is larger than {limit} bytes")
    except httpx.TransportError as exc:
        raise _broken(method, path, exc) from exc
    return bytes(data)


def _lines(resp: httpx.Response, method: str, path: str) -> Iterator[bytes]:
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
    except httpx.TransportError as exc:
        raise _StreamBroken(f"{method} {path}: {_reason(exc)}", isinstance(exc, httpx.TimeoutException)) from exc
    raise _StreamBroken(f"{method} {path}: the stream ended before the job did", False)


def _api_error(method: str, path: str, resp: httpx.Response) -> JobAPIError:
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
