"""The blocking client: `Sandbox` and its `files`."""

from __future__ import annotations

import os
from collections.abc import Callable

import httpx

from microvm_check import _wire
from microvm_check._wire import Call, ExecResult, SandboxError, Service
from microvm_check.contract import (
    SANDBOX_TOKEN_HEADER,
    CreateAnswer,
    DestroyAnswer,
    FileEntry,
    Listing,
    SandboxInfo,
    SnapshotAnswer,
)

OnOutput = Callable[[str, bytes], None]


class _Sender:
    """Sends a Call with httpx.Client; errors become SandboxError."""

    def __init__(self, service: Service, token: str | None = None) -> None:
        self.service = service
        headers = service.headers() | ({SANDBOX_TOKEN_HEADER: token} if token else {})
        self._http = httpx.Client(transport=httpx.HTTPTransport(**service.transport_args()),
                                  base_url=service.base_url(), headers=headers, follow_redirects=False)

    def close(self) -> None:
        self._http.close()

    def send(self, call: Call, max_bytes: int = _wire.MAX_ANSWER) -> bytes:
        try:
            with self._http.stream(call.method, call.path, params=call.params, json=call.json, content=call.content,
                                   timeout=_wire.timeout_of(call)) as answer:
                body = bytearray()
                for chunk in answer.iter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise SandboxError(f"{call.method} {call.path}: the answer is larger than {max_bytes} bytes")
                if answer.status_code >= 400:
                    raise _wire.error_of(call, answer.status_code, bytes(body))
                return bytes(body)
        except httpx.TransportError as exc:
            raise SandboxError(f"{call.method} {call.path}: the service at {self.service.socket or self.service.url} "
                               f"was not reached or broke off: {exc}") from exc

    def lines(self, call: Call, take: Callable[[bytes], None]) -> None:
        try:
            with self._http.stream(call.method, call.path, json=call.json, timeout=_wire.timeout_of(call)) as answer:
                if answer.status_code >= 400:
                    raise _wire.error_of(call, answer.status_code, answer.read()[:_wire.MAX_ANSWER])
                for line in answer.iter_lines():
                    take(line.encode())
        except httpx.TransportError as exc:
            raise SandboxError(f"{call.method} {call.path}: the service broke off: {exc}") from exc


class Files:
    """Single files in the sandbox (absolute guest paths)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else data
        self._sbx._send(_wire.write_call(self._sbx.id, path, payload, mode))

    def read(self, path: str) -> bytes:
        return self._sbx._send(_wire.read_call(self._sbx.id, path))

    def list(self, path: str = "/workspace") -> list[FileEntry]:
        call = _wire.list_call(self._sbx.id, path)
        return list(_wire.answer_of(call, self._sbx._send(call), Listing.from_wire).entries)


class Sandbox:
    """A sandbox VM of a running microvm-check service, driven over its job API.

        with Sandbox.create(template="base", ttl_seconds=600) as sbx:
            r = sbx.exec("pytest -q", timeout=300, on_output=lambda stream, data: print(data.decode(), end=""))

    The service owns it: its TTL is enforced there (a caller that dies leaks nothing), its egress is
    the operator's policy for the configured repository, narrowed by `policy`. For embedding a VM in
    your own root process instead, see runner.sandbox (the in-process Sandbox)."""

    def __init__(self, service: Service, info: SandboxInfo, token: str) -> None:
        self.service = service
        self.id = info.id
        self.info = info
        self.token = token
        self._sender = _Sender(service, token)
        self._destroyed = False
        self.files = Files(self)

    @classmethod
    def create(cls, template: str | None = None, base: str | None = None, policy: str | None = None,
               ttl_seconds: float = 600.0, size: str | None = None, *, service: Service | None = None,
               socket: str | None = None, url: str | None = None, token: str | None = None) -> Sandbox:
        """A fresh VM from `template` (the service's default when None) or from a snapshot `base`."""
        where = service or (Service(socket, url, token) if socket or url else Service.from_env())
        call = _wire.create_call(template, base, policy, ttl_seconds, size)
        sender = _Sender(where)
        try:
            answer = _wire.answer_of(call, sender.send(call), CreateAnswer.from_wire)
        finally:
            sender.close()
        return cls(where, answer.info, answer.token)

    @classmethod
    def connect(cls, sandbox_id: str, sandbox_token: str, service: Service | None = None) -> Sandbox:
        """A sandbox created elsewhere (another process of yours), by the id and token its create answered;
        its info is asked anew, so a wrong token or an ended sandbox is refused here (403, 404)."""
        where = service or Service.from_env()
        call = _wire.info_call(sandbox_id)
        sender = _Sender(where, sandbox_token)
        try:
            info = _wire.answer_of(call, sender.send(call), SandboxInfo.from_wire)
        finally:
            sender.close()
        return cls(where, info, sandbox_token)

    def _send(self, call: Call, max_bytes: int = _wire.MAX_ANSWER) -> bytes:
        if self._destroyed:
            raise SandboxError(f"sandbox {self.id} was destroyed by this client")
        return self._sender.send(call, max_bytes)

    def exec(self, command: str | list[str], timeout: float | None = None, cwd: str = "/workspace",
             env: dict[str, str] | None = None, on_output: OnOutput | None = None,
             capture_bytes: int = 16 * 1024 * 1024) -> ExecResult:
        """Run a shell string (or an argv list, no shell) and wait; output streams to `on_output` as it comes.
        A non-zero exit is a result; at most `capture_bytes` per stream are kept in it."""
        reader = _wire.ExecReader(on_output, capture_bytes)
        if self._destroyed:
            raise SandboxError(f"sandbox {self.id} was destroyed by this client")
        self._sender.lines(_wire.exec_call(self.id, command, timeout, cwd, env), reader.line)
        return reader.result()

    def upload(self, source: str | os.PathLike[str] | bytes, dest: str = "/workspace") -> None:
        """A directory's contents, a .tar file or tar bytes, unpacked into `dest`."""
        self._send(_wire.upload_call(self.id, source, dest))

    def download(self, *globs: str, cwd: str = "/workspace", max_bytes: int = _wire.DEFAULT_DOWNLOAD) -> bytes:
        """A tar of the regular files matching `globs` (relative to `cwd`), checked and re-written by the service:
        each file it left out is an empty note `.microvm-check-skipped/N` saying which and why (docs/sdk.md)."""
        return self._send(_wire.download_call(self.id, list(globs), cwd), max_bytes)

    def snapshot(self) -> str:
        """A snapshot of this sandbox as it is now: a base for `Sandbox.create(base=...)` (yours only)."""
        call = _wire.snapshot_call(self.id)
        return _wire.answer_of(call, self._send(call), SnapshotAnswer.from_wire).base

    def fork(self, ttl_seconds: float = 600.0, policy: str | None = None) -> Sandbox:
        """A new sandbox restored from a snapshot of this one (its files and processes as they are now)."""
        return Sandbox.create(base=self.snapshot(), policy=policy, ttl_seconds=ttl_seconds, service=self.service)

    def destroy(self) -> None:
        """End the sandbox now (once gone, later calls are answered 404)."""
        try:
            call = _wire.destroy_call(self.id)
            _wire.answer_of(call, self._send(call), DestroyAnswer.from_wire)
        except SandboxError as exc:
            if exc.status != 404:
                raise
        finally:
            self._destroyed = True
            self._sender.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
