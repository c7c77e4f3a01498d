"""A client for the job API (docs/job-api.md), used by the action and by `microvm-check run`.

Split like httpx: `JobClient` knows the API, a transport knows how to reach the service (a Unix
socket or TCP, through `http.client`). Bodies stream in both directions, so a large checkout or
artifact tar never sits whole in memory. Each call opens its own connection, which keeps the client
safe to share between threads (one thread following logs while another cancels).
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Iterator
from urllib.parse import urlsplit

DEFAULT_SOCKET = "/run/microvm-check/api.sock"
_CHUNK = 1024 * 1024
_MAX_LINE = 4 * 1024 * 1024  # one log entry, base64: far above the service's entry size
_MAX_JSON = 16 * 1024 * 1024


class JobAPIError(Exception):
    """The service refused a request or could not be reached; `status` is None when unreachable."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


@dataclass(frozen=True)
class LogEntry:
    seq: int
    stream: str
    ts: float
    data: bytes


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class Transport:
    """Opens one HTTP/1.1 connection per request to the service."""

    def __init__(self, socket_path: str | None = None, url: str | None = None, timeout: float | None = 60.0) -> None:
        if (socket_path is None) == (url is None):
            raise ValueError("give exactly one of socket_path or url")
        self.socket_path = socket_path
        self.timeout = timeout
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"url: expected http(s)://HOST:PORT, got {url!r}")
            self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.where = socket_path or url

    def connection(self) -> http.client.HTTPConnection:
        if self.socket_path is not None:
            return _UnixConnection(self.socket_path, self.timeout)
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; the caller reads the response and closes the connection."""
        conn = self.connection()
        chunked = body is not None and not isinstance(body, (bytes, bytearray))
        try:
            try:
                conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the service refused mid-body (413, 429): its answer is still waiting to be read
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise JobAPIError(f"cannot reach the job service at {self.where}: {exc}") from exc


class JobClient:
    def __init__(self, socket: str | None = None, url: str | None = None, token: str | None = None,
                 timeout: float | None = 60.0, transport: Transport | None = None) -> None:
        if transport is None:
            if socket is None and url is None:
                socket = DEFAULT_SOCKET
            transport = Transport(socket_path=socket, url=url, timeout=timeout)
        self.transport = transport
        self.token = token

    # -- the API ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/v1/health")

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._json("POST", "/v1/jobs", json.dumps(spec).encode(), {"Content-Type": "application/json"})

    def upload_checkout(self, job_id: str, data: BinaryIO | Iterable[bytes] | bytes) -> dict[str, Any]:
        body = data if isinstance(data, (bytes, bytearray)) else _chunks(data)
        return self._json("PUT", f"/v1/jobs/{_id(job_id)}/checkout", body, {"Content-Type": "application/x-tar"})

    def get(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{_id(job_id)}")

    def list(self, limit: int = 50) -> list[dict[str, Any]]:
        return self._json("GET", f"/v1/jobs?limit={int(limit)}")["jobs"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{_id(job_id)}/cancel")

    def logs(self, job_id: str, after: int = 0, reconnects: int = 3) -> Iterator[LogEntry]:
        """Follow a job's log live; ends when the job has ended. A dropped connection resumes after the last seq."""
        while True:
            try:
                for entry in self._log_stream(job_id, after):
                    after = entry.seq
                    yield entry
                return
            except _StreamBroken:
                if reconnects <= 0:
                    raise JobAPIError(f"the log stream of job {job_id} broke repeatedly") from None
                reconnects -= 1

    def artifacts(self, job_id: str, out: BinaryIO) -> int:
        """Write the job's artifact tar to `out`; returns the bytes written."""
        conn, resp = self._send("GET", f"/v1/jobs/{_id(job_id)}/artifacts")
        try:
            written = 0
            while chunk := resp.read(_CHUNK):
                out.write(chunk)
                written += len(chunk)
            return written
        finally:
            conn.close()

    # -- plumbing -----------------------------------------------------------------------------

    def _headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        headers = dict(extra or {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _send(self, method: str, path: str, body: Any = None,
              headers: dict[str, str] | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn, resp = self.transport.request(method, path, body, self._headers(headers))
        if resp.status >= 400:
            try:
                raise _api_error(method, path, resp)
            finally:
                conn.close()
        return conn, resp

    def _json(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        conn, resp = self._send(method, path, body, headers)
        try:
            data = resp.read(_MAX_JSON + 1)
        except (OSError, http.client.HTTPException) as exc:
            raise JobAPIError(f"{method} {path}: the answer broke off: {exc}") from exc
        finally:
            conn.close()
        if len(data) > _MAX_JSON:
            raise JobAPIError(f"{method} {path}: the answer is larger than {_MAX_JSON} bytes")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise JobAPIError(f"{method} {path}: the answer is not JSON: {exc}") from exc

    def _log_stream(self, job_id: str, after: int) -> Iterator[LogEntry]:
        try:
            conn, resp = self._send("GET", f"/v1/jobs/{_id(job_id)}/logs?after={int(after)}")
        except JobAPIError as exc:
            if exc.status is None:
                raise _StreamBroken() from exc
            raise
        try:
            while True:
                try:
                    line = resp.readline(_MAX_LINE)
                except (OSError, http.client.HTTPException) as exc:
                    raise _StreamBroken() from exc
                if not line.endswith(b"\n"):
                    raise _StreamBroken()
                obj = json.loads(line)
                if obj.get("end"):
                    return
                yield LogEntry(int(obj["seq"]), str(obj["stream"]), float(obj["ts"]), base64.b64decode(obj["data"]))
        finally:
            conn.close()


class _StreamBroken(Exception):
    pass


def _api_error(method: str, path: str, resp: http.client.HTTPResponse) -> JobAPIError:
    try:
        message = json.loads(resp.read(64 * 1024)).get("error")
    except (ValueError, AttributeError, OSError, http.client.HTTPException):
        message = None
    retry = resp.getheader("Retry-After")
    return JobAPIError(
        f"{method} {path}: {resp.status} {message or resp.reason}",
        status=resp.status,
        retry_after=float(retry) if retry and retry.isdigit() else None,
    )


def _chunks(data: BinaryIO | Iterable[bytes]) -> Iterator[bytes]:
    read = getattr(data, "read", None)
    if read is None:
        yield from (bytes(chunk) for chunk in data if chunk)
        return
    while chunk := read(_CHUNK):
        yield chunk


def _id(job_id: str) -> str:
    if not job_id or not all(c.isalnum() or c in "-_" for c in job_id):
        raise JobAPIError(f"not a job id: {job_id!r}")
    return job_id
