"""The asyncio client: `AsyncSandbox`, the same calls as `Sandbox` on httpx.AsyncClient."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

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
    TerminalEnd,
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


    async def upgrade(self, call: Call) -> httpx.Response:
        request = self._http.build_request(call.method, call.path, params=call.params, headers=dict(call.headers),
                                           timeout=_wire.timeout_of(call))
        try:
            answer = await self._http.send(request, stream=True)
            if answer.status_code == 101:
                return answer
            try:
                body = bytearray()
                async for chunk in answer.aiter_bytes():
                    body += chunk
                    if len(body) > _wire.MAX_ANSWER:
                        break
            finally:
                await answer.aclose()
        except httpx.TransportError as exc:
            raise SandboxError(f"{call.method} {call.path}: the service was not reached or broke off: {exc}") from exc
        if answer.status_code < 400:
            raise SandboxError(f"{call.method} {call.path}: the service answered {answer.status_code}, not 101")
        raise _wire.error_of(call, answer.status_code, bytes(body[: _wire.MAX_ANSWER]))


class AsyncTerminal:
    """`Terminal` for asyncio: `async with await sbx.terminal() as term: await term.write(...)`, `async for
    chunk in term`, `await term.wait()`. Its output is the terminal's raw bytes."""

    def __init__(self, answer: httpx.Response, what: str) -> None:
        self._answer = answer
        self._stream = answer.extensions["network_stream"]
        self._reader = _wire.TerminalReader(what)
        self._pending: deque[bytes] = deque()
        self._write_lock = asyncio.Lock()
        self._closed = False
        self.what = what

    @property
    def end(self) -> TerminalEnd | None:
        return self._reader.end

    @property
    def exit_code(self) -> int | None:
        end = self._reader.end
        return end.exit_code if end is not None else None

    async def write(self, data: bytes | str) -> None:
        await self._send(_wire.input_frames(data))

    async def resize(self, rows: int, cols: int) -> None:
        await self._send(_wire.resize_frame(rows, cols))

    async def signal(self, name: str = "INT") -> None:
        await self._send(_wire.signal_frame(name))

    async def read(self, timeout: float | None = None) -> bytes:
        while not self._pending:
            if self._reader.end is not None:
                return b""
            if self._closed:
                raise SandboxError(f"{self.what}: the terminal was closed")
            try:
                data = await self._stream.read(_wire.TERMINAL_READ, timeout=timeout)
            except Exception as exc:
                raise _wire.stream_error(self.what, exc) from exc
            self._pending.extend(self._reader.feed(data))
        return self._pending.popleft()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read():
            yield chunk

    async def wait(self, timeout: float | None = None) -> TerminalEnd:
        while await self.read(timeout):
            pass
        end = self._reader.end
        assert end is not None
        if end.error is not None:
            raise SandboxError(f"{self.what}: {end.error}")
        return end

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.aclose()
        except Exception:
            pass
        finally:
            await self._answer.aclose()

    async def _send(self, frames: bytes) -> None:
        if self._closed:
            raise SandboxError(f"{self.what}: the terminal was closed")
        async with self._write_lock:
            try:
                await self._stream.write(frames, timeout=_wire.TERMINAL_WRITE_SECONDS)
            except Exception as exc:
                raise _wire.stream_error(self.what, exc) from exc

    async def __aenter__(self) -> AsyncTerminal:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


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
                   capture_bytes: int = 16 * 1024 * 1024, stdin: bytes | str | None = None) -> ExecResult:
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
        await self._sender.lines(_wire.exec_call(self.id, command, timeout, cwd, env, stdin), take)
        return reader.result()

    async def terminal(self, command: str | list[str] | None = None, rows: int = 24, cols: int = 80,
                       cwd: str = "/workspace", env: dict[str, str] | None = None) -> AsyncTerminal:
        call = _wire.terminal_call(self.id, command, rows, cols, cwd, env)
        if self._destroyed:
            raise SandboxError(f"sandbox {self.id} was destroyed by this client")
        return AsyncTerminal(await self._sender.upgrade(call), f"terminal of sandbox {self.id}")

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

    async def hibernate(self) -> None:
        call = _wire.hibernate_call(self.id)
        self.info = _wire.answer_of(call, await self._send(call), SandboxInfo.from_wire)

    @classmethod
    async def resume(cls, sandbox_id: str, sandbox_token: str, service: Service | None = None) -> AsyncSandbox:
        where = service or Service.from_env()
        call = _wire.resume_call(sandbox_id)
        sender = _AsyncSender(where, sandbox_token)
        try:
            info = _wire.answer_of(call, await sender.send(call), SandboxInfo.from_wire)
        finally:
            await sender.close()
        return cls(where, info, sandbox_token)

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
