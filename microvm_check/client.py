"""The blocking client: `Sandbox`, its `files` and its `terminal()`."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from socket import SHUT_RDWR

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


    def upgrade(self, call: Call) -> httpx.Response:
        """The 101 answer to a call asking for an Upgrade (its connection is the caller's from here), or the
        refusal as SandboxError."""
        request = self._http.build_request(call.method, call.path, params=call.params, headers=dict(call.headers),
                                           timeout=_wire.timeout_of(call))
        try:
            answer = self._http.send(request, stream=True)
            if answer.status_code == 101:
                return answer
            try:
                body = bytearray()
                for chunk in answer.iter_bytes():
                    body += chunk
                    if len(body) > _wire.MAX_ANSWER:
                        break
            finally:
                answer.close()
        except httpx.TransportError as exc:
            raise SandboxError(f"{call.method} {call.path}: the service at {self.service.socket or self.service.url} "
                               f"was not reached or broke off: {exc}") from exc
        if answer.status_code < 400:
            raise SandboxError(f"{call.method} {call.path}: the service answered {answer.status_code}, not 101")
        raise _wire.error_of(call, answer.status_code, bytes(body[: _wire.MAX_ANSWER]))


class Terminal:
    """A program on a terminal of its own in the sandbox's VM (`Sandbox.terminal()`), over one connection:

        with sbx.terminal(rows=40, cols=120) as term:       # the sandbox's shell
            term.write("make test\n")
            for chunk in term:                               # raw terminal bytes, until the program ends
                ...
            print(term.wait().exit_code)

    Its output is the terminal's raw bytes, escape sequences and all, for a program to read (not shown
    to a person's terminal as it is). `write`, `resize` and `signal` may come from any thread, reading
    from one. Closing it (detaching) ends the program and never the sandbox."""

    def __init__(self, answer: httpx.Response, what: str) -> None:
        self._answer = answer
        self._stream = answer.extensions["network_stream"]
        self._reader = _wire.TerminalReader(what)
        self._pending: deque[bytes] = deque()
        self._write_lock = threading.Lock()
        self._closed = False
        self.what = what

    @property
    def end(self) -> TerminalEnd | None:
        """How the program ended (once the output was read to its end), else None."""
        return self._reader.end

    @property
    def exit_code(self) -> int | None:
        end = self._reader.end
        return end.exit_code if end is not None else None

    def write(self, data: bytes | str) -> None:
        """Typed input (a str is sent as UTF-8); "\x03" is Ctrl-C as a terminal types it."""
        self._send(_wire.input_frames(data))

    def resize(self, rows: int, cols: int) -> None:
        """The terminal's new size; its program gets SIGWINCH."""
        self._send(_wire.resize_frame(rows, cols))

    def signal(self, name: str = "INT") -> None:
        """A signal by name (INT, QUIT, TERM, HUP, KILL, TSTP, CONT) to the terminal's foreground process group."""
        self._send(_wire.signal_frame(name))

    def read(self, timeout: float | None = None) -> bytes:
        """The next output chunk as it comes; b"" once the program has ended (`end` says how). TimeoutError
        when nothing came within `timeout` seconds (None: wait)."""
        while not self._pending:
            if self._reader.end is not None:
                return b""
            if self._closed:
                raise SandboxError(f"{self.what}: the terminal was closed")
            try:
                data = self._stream.read(_wire.TERMINAL_READ, timeout=timeout)
            except Exception as exc:
                raise _wire.stream_error(self.what, exc) from exc
            self._pending.extend(self._reader.feed(data))
        return self._pending.popleft()

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read():
            yield chunk

    def wait(self, timeout: float | None = None) -> TerminalEnd:
        """Read (and drop) the output to the program's end: how it ended. SandboxError when the session ended
        without an exit status (the VM went, the output budget was passed)."""
        while self.read(timeout):
            pass
        end = self._reader.end
        assert end is not None
        if end.error is not None:
            raise SandboxError(f"{self.what}: {end.error}")
        return end

    def close(self) -> None:
        """Detach: the program is ended (if it runs still), the sandbox runs on."""
        if self._closed:
            return
        self._closed = True
        try:
            raw = self._stream.get_extra_info("socket")
            if raw is not None:
                raw.shutdown(SHUT_RDWR)  # a read blocked in another thread ends now
            self._stream.close()
        except Exception:
            pass  # already gone: closing is all that was asked
        finally:
            self._answer.close()

    def _send(self, frames: bytes) -> None:
        if self._closed:
            raise SandboxError(f"{self.what}: the terminal was closed")
        with self._write_lock:
            try:
                raw = self._stream.get_extra_info("socket")
                if raw is not None:  # not the stream's write, which sets the socket's timeout under a reading thread
                    raw.sendall(frames)
                else:
                    self._stream.write(frames, timeout=_wire.TERMINAL_WRITE_SECONDS)
            except Exception as exc:
                raise _wire.stream_error(self.what, exc) from exc

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
             capture_bytes: int = 16 * 1024 * 1024, stdin: bytes | str | None = None) -> ExecResult:
        """Run a shell string (or an argv list, no shell) and wait; output streams to `on_output` as it comes.
        A non-zero exit is a result; at most `capture_bytes` per stream are kept in it. `stdin` is the
        command's whole input (at most 512 KiB; else it reads an empty one)."""
        reader = _wire.ExecReader(on_output, capture_bytes)
        if self._destroyed:
            raise SandboxError(f"sandbox {self.id} was destroyed by this client")
        self._sender.lines(_wire.exec_call(self.id, command, timeout, cwd, env, stdin), reader.line)
        return reader.result()

    def terminal(self, command: str | list[str] | None = None, rows: int = 24, cols: int = 80,
                 cwd: str = "/workspace", env: dict[str, str] | None = None) -> Terminal:
        """A program on a terminal of its own in the VM (None: the sandbox's shell; a string runs under sh -c),
        streamed both ways until it ends or the Terminal is closed; the sandbox runs on after it. It holds one
        of the sandbox's concurrent calls and ends past the service's exec deadline."""
        call = _wire.terminal_call(self.id, command, rows, cols, cwd, env)
        if self._destroyed:
            raise SandboxError(f"sandbox {self.id} was destroyed by this client")
        return Terminal(self._sender.upgrade(call), f"terminal of sandbox {self.id}")

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

    def hibernate(self) -> None:
        """Park the sandbox: its VM's memory and disk are kept on the host and the VM stops, so it costs no
        CPU or memory until `Sandbox.resume`; its TTL runs on. Other calls are refused (409) until then, and
        one under way makes this a 409. Leaving a `with` block still destroys it: park a sandbox you hold
        without one."""
        call = _wire.hibernate_call(self.id)
        self.info = _wire.answer_of(call, self._send(call), SandboxInfo.from_wire)

    @classmethod
    def resume(cls, sandbox_id: str, sandbox_token: str, service: Service | None = None) -> Sandbox:
        """A hibernated sandbox back where it was (its files, its processes), by the id and token its create
        answered: a fresh random seed and the host's clock, the same id and token, what is left of its TTL.
        A sandbox that is not hibernated is a 409."""
        where = service or Service.from_env()
        call = _wire.resume_call(sandbox_id)
        sender = _Sender(where, sandbox_token)
        try:
            info = _wire.answer_of(call, sender.send(call), SandboxInfo.from_wire)
        finally:
            sender.close()
        return cls(where, info, sandbox_token)

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
