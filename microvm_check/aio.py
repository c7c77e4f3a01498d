"""The asyncio client: `AsyncSandbox`, the same calls as `Sandbox` on httpx.AsyncClient."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

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

OnOutput = Callable[[str, bytes], None | Awaitable[None]]


class _AsyncSender:
    def __init__(self, service: Service, token: str | None = None) -> None:
        self.service = service
        headers = service.headers() | ({SANDBOX_TOKEN_HEADER: token} if token else {})
        self._http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(**service.transport_args()),
                                       base_url=service.base_url(), headers=headers, follow_redirects=False)

    async def close(self) -> None:
        await self._http.aclose()

    async def send(self, call: Call, max_bytes: int = _wire.MAX_ANSWER) -> bytes:
        try:
            async with self._http.stream(call.method, call.path, params=call.params, json=call.json,
                                         content=call.content, timeout=_wire.timeout_of(call)) as answer:
                body = bytearray()
                async for chunk in answer.aiter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise SandboxError(f"{call.method} {call.path}: the answer is larger than {max_bytes} bytes")
                if answer.status_code >= 400:
                    raise _wire.error_of(call, answer.status_code, bytes(body))
                return bytes(body)
        except httpx.TransportError as exc:
            raise SandboxError(f"{call.method} {call.path}: the service was not reached or broke off: {exc}") from exc

    async def lines(self, call: Call, take: Callable[[bytes], Awaitable[None]]) -> None:
        try:
            async with self._http.stream(call.method, call.path, json=call.json,
                                         timeout=_wire.timeout_of(call)) as answer:
                if answer.status_code >= 400:
                    raise _wire.error_of(call, answer.status_code, (await answer.aread())[:_wire.MAX_ANSWER])
                async for line in answer.aiter_lines():
                    await take(line.encode())
        except httpx.TransportError as exc:
            raise SandboxError(f"{call.method} {call.path}: the service broke off: {exc}") from exc


class AsyncFiles:
    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sbx = sandbox

    async def write(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        payload = data.encode() if isinstance(data, str) else data
        await self._sbx._send(_wire.write_call(self._sbx.id, path, payload, mode))

    async def read(self, path: str) -> bytes:
        return await self._sbx._send(_wire.read_call(self._sbx.id, path))

    async def list(self, path: str = "/workspace") -> list[FileEntry]:
        call = _wire.list_call(self._sbx.id, path)
        return list(_wire.answer_of(call, await self._sbx._send(call), Listing.from_wire).entries)


class AsyncSandbox:
    """`Sandbox` for asyncio: `async with await AsyncSandbox.create(...) as sbx: await sbx.exec(...)`;
    `on_output` may be a plain function or a coroutine function."""

    def __init__(self, service: Service, info: SandboxInfo, token: str) -> None:
        self.service, self.id, self.info, self.token = service, info.id, info, token
        self._sender = _AsyncSender(service, token)
        self._destroyed = False
        self.files = AsyncFiles(self)

    @classmethod
    async def create(cls, template: str | None = None, base: str | None = None, policy: str | None = None,
                     ttl_seconds: float = 600.0, size: str | None = None, *, service: Service | None = None,
                     socket: str | None = None, url: str | None = None, token: str | None = None) -> AsyncSandbox:
        where = service or (Service(socket, url, token) if socket or url else Service.from_env())
        call = _wire.create_call(template, base, policy, ttl_seconds, size)
        sender = _AsyncSender(where)
        try:
            answer = _wire.answer_of(call, await sender.send(call), CreateAnswer.from_wire)
        finally:
            await sender.close()
        return cls(where, answer.info, answer.token)

    @classmethod
    async def connect(cls, sandbox_id: str, sandbox_token: str, service: Service | None = None) -> AsyncSandbox:
        where = service or Service.from_env()
        call = _wire.info_call(sandbox_id)
        sender = _AsyncSender(where, sandbox_token)
        try:
            info = _wire.answer_of(call, await sender.send(call), SandboxInfo.from_wire)
        finally:
            await sender.close()
        return cls(where, info, sandbox_token)

    async def _send(self, call: Call, max_bytes: int = _wire.MAX_ANSWER) -> bytes:
        if self._destroyed:
            raise SandboxError(f"sandbox {self.id} was destroyed by this client")
        return await self._sender.send(call, max_bytes)

    async def exec(self, command: str | list[str], timeout: float | None = None, cwd: str = "/workspace",
                   env: dict[str, str] | None = None, on_output: OnOutput | None = None,
                   capture_bytes: int = 16 * 1024 * 1024) -> ExecResult:
        pending: list[Awaitable[None]] = []

        def collect(stream: str, data: bytes) -> None:
            if on_output is not None:
                outcome = on_output(stream, data)
                if outcome is not None:
                    pending.append(outcome)

        reader = _wire.ExecReader(collect, capture_bytes)

        async def take(line: bytes) -> None:
            reader.line(line)
            while pending:
                await pending.pop(0)

        if self._destroyed:
            raise SandboxError(f"sandbox {self.id} was destroyed by this client")
        await self._sender.lines(_wire.exec_call(self.id, command, timeout, cwd, env), take)
        return reader.result()

    async def upload(self, source: str | os.PathLike[str] | bytes, dest: str = "/workspace") -> None:
        await self._send(_wire.upload_call(self.id, source, dest))

    async def download(self, *globs: str, cwd: str = "/workspace", max_bytes: int = _wire.DEFAULT_DOWNLOAD) -> bytes:
        return await self._send(_wire.download_call(self.id, list(globs), cwd), max_bytes)

    async def snapshot(self) -> str:
        call = _wire.snapshot_call(self.id)
        return _wire.answer_of(call, await self._send(call), SnapshotAnswer.from_wire).base

    async def fork(self, ttl_seconds: float = 600.0, policy: str | None = None) -> AsyncSandbox:
        return await AsyncSandbox.create(base=await self.snapshot(), policy=policy, ttl_seconds=ttl_seconds,
                                         service=self.service)

    async def destroy(self) -> None:
        try:
            call = _wire.destroy_call(self.id)
            _wire.answer_of(call, await self._send(call), DestroyAnswer.from_wire)
        except SandboxError as exc:
            if exc.status != 404:
                raise
        finally:
            self._destroyed = True
            await self._sender.close()

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()
