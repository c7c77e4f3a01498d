"""The host's side of the guest agent channel, written for a guest that may be hostile.

One reader thread turns the byte stream into validated frames and routes them to the request
they belong to; callers wait on their own bounded queue with a deadline. Anything off (a bad
header, an oversized or truncated frame, a reply to a request never sent, silence past a
deadline) marks the channel broken: every waiter gets an `AgentError` and the owner is told, so
the VM is destroyed rather than trusted again. Memory use is bounded by the queue sizes, and a
guest that stops reading cannot block a sender past its deadline.
"""

from __future__ import annotations

import base64
import itertools
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from runner.vm.errors import AgentError
from vmimages.guest import protocol as P

QUEUE_FRAMES = 64  # per request: at most 64 x 256 KiB buffered before the reader waits
POLL_S = 0.25
MAX_STRAY_FRAMES = 10_000  # late frames for finished requests tolerated before we call it abuse
KILL_GRACE_S = 10.0  # how long past its timeout a command may take before the host steps in


@dataclass
class ExecOutcome:
    exit_code: int
    timed_out: bool
    killed: bool


class _Request:
    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.frames: queue.Queue = queue.Queue(maxsize=QUEUE_FRAMES)
        self.abandoned = False


_BROKEN = object()


class AgentClient:
    def __init__(self, sock: socket.socket, on_broken: Callable[[str], None] | None = None) -> None:
        self._sock = sock
        self._sock.settimeout(POLL_S)
        self._on_broken = on_broken
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._issued = 0
        self._pending: dict[int, _Request] = {}
        self._stray = 0
        self._execs: set[int] = set()
        self.broken: str | None = None
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name="agent-reader", daemon=True)
        self._reader.start()

    # ---- channel ---------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        self._fail("the sandbox was destroyed")

    def _recv(self, n: int) -> bytes:
        while True:
            if self._closed:
                return b""
            try:
                return self._sock.recv(n)
            except socket.timeout:
                continue
            except OSError:
                return b""

    def _read_loop(self) -> None:
        reader = P.FrameReader(self._recv)
        try:
            while True:
                frame = reader.next()
                if frame is None:
                    self._fail("the guest closed its agent channel")
                    return
                self._route(frame)
        except P.ProtocolError as exc:
            self._fail(f"the guest agent broke the protocol: {exc}")

    def _route(self, frame: P.Frame) -> None:
        if frame.kind == P.MSG:
            frame.json()  # validate in the reader: a bad message breaks the channel now
        with self._lock:
            req = self._pending.get(frame.request_id)
            if req is None:
                if frame.request_id == 0 or frame.request_id > self._issued:
                    raise P.ProtocolError(f"frame for request {frame.request_id}, which was never sent")
                self._stray += 1
                if self._stray > MAX_STRAY_FRAMES:
                    raise P.ProtocolError("too many frames for requests that already ended")
                return
        while not req.abandoned:
            try:
                req.frames.put(frame, timeout=POLL_S)
                return
            except queue.Full:
                if self._closed:
                    return

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.broken is not None:
                return
            self.broken = why
            pending = list(self._pending.values())
        for req in pending:
            _offer(req.frames, _BROKEN)
        if self._on_broken and not self._closed:
            self._on_broken(why)

    def _abuse(self, why: str) -> None:
        """The guest ignored a limit it was told: stop trusting the channel."""
        self._fail(why)
        raise AgentError(why)

    def _send(self, data: bytes, deadline: float) -> None:
        with self._send_lock:
            view = memoryview(data)
            while view:
                if self.broken:
                    raise AgentError(self.broken)
                try:
                    view = view[self._sock.send(view) :]
                except socket.timeout:
                    if time.monotonic() > deadline:
                        self._fail("the guest stopped reading its agent channel")
                        raise AgentError(self.broken) from None
                except OSError as exc:
                    self._fail(f"the agent channel failed: {exc}")
                    raise AgentError(self.broken) from None

    # ---- requests --------------------------------------------------------------------------
    def _open(self, message: dict, deadline: float) -> _Request:
        with self._lock:
            if self.broken:
                raise AgentError(self.broken)
            rid = next(self._ids)
            self._issued = rid
            req = _Request(rid)
            self._pending[rid] = req
        self._send(P.encode_msg(rid, message), deadline)
        return req

    def _finish(self, req: _Request) -> None:
        req.abandoned = True
        with self._lock:
            self._pending.pop(req.rid, None)
        while True:  # let a reader blocked on this queue go
            try:
                req.frames.get_nowait()
            except queue.Empty:
                return

    def _frames(self, req: _Request, deadline: float | None) -> Iterator[P.Frame]:
        """Frames of one request up to its final reply, which is yielded last."""
        while True:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise TimeoutError
            try:
                frame = req.frames.get(timeout=min(wait, POLL_S) if wait is not None else POLL_S)
            except queue.Empty:
                continue
            if frame is _BROKEN:
                raise AgentError(self.broken or "agent channel broken")
            yield frame
            if frame.kind == P.MSG and "ok" in frame.json():
                return

    def _send_data(self, req: _Request, chunks: Iterable[bytes], deadline: float) -> None:
        for chunk in chunks:
            for start in range(0, len(chunk), P.MAX_CHUNK):
                self._send(P.encode(P.DATA, req.rid, chunk[start : start + P.MAX_CHUNK]), deadline)
        self._send(P.encode(P.END, req.rid), deadline)

    def call(
        self,
        message: dict,
        timeout: float,
        data: Iterable[bytes] | None = None,
        on_frame: Callable[[P.Frame], None] | None = None,
    ) -> dict:
        """Send a request (and its data), hand intermediate frames to `on_frame`, return the reply."""
        deadline = time.monotonic() + timeout
        req = self._open(message, deadline)
        try:
            if data is not None:
                self._send_data(req, data, deadline)
            for frame in self._frames(req, deadline):
                if frame.kind == P.MSG and "ok" in frame.json():
                    return self._check(message, frame.json())
                if on_frame is not None:
                    on_frame(frame)
            raise AgentError("request ended without a reply")  # unreachable by construction of _frames
        except TimeoutError:
            self._fail(f"the guest agent did not answer {message.get('op')!r} within {timeout:.0f} s")
            raise AgentError(self.broken) from None
        finally:
            self._finish(req)

    @staticmethod
    def _check(message: dict, reply: dict) -> dict:
        if reply.get("ok") is True:
            return reply
        error = str(reply.get("error", "no reason given"))[:2000]
        raise GuestOpError(f"{message.get('op')} failed in the guest: {error}")

    # ---- operations ------------------------------------------------------------------------
    def ping(self, timeout: float = 10.0) -> dict:
        return self.call({"op": "ping"}, timeout)

    def identity(self, hostname: str, vm_id: str, timeout: float = 10.0) -> None:
        seed = base64.b64encode(os.urandom(64)).decode()
        message = {"op": "identity", "time_ns": time.time_ns(), "seed": seed, "hostname": hostname, "vm_id": vm_id}
        self.call(message, timeout)

    def exec(
        self,
        message: dict,
        on_output: Callable[[str, bytes], None],
        timeout: float | None,
    ) -> ExecOutcome:
        """Run a command; output goes to `on_output` as it arrives. The host enforces the timeout too."""
        limit = timeout + KILL_GRACE_S if timeout is not None else 7 * 24 * 3600.0
        deadline = time.monotonic() + limit
        message = {**message, "op": "exec", "timeout": timeout}
        req = self._open(message, deadline)
        self._execs.add(req.rid)
        try:
            for frame in self._frames(req, deadline):
                if frame.kind in (P.STDOUT, P.STDERR):
                    on_output("stdout" if frame.kind == P.STDOUT else "stderr", frame.payload)
                elif frame.kind == P.MSG and "ok" in frame.json():
                    return _exec_outcome(self._check(message, frame.json()))
        except TimeoutError:
            self._fail(f"the guest did not end the command {KILL_GRACE_S:.0f} s after its timeout")
            raise AgentError(self.broken) from None
        finally:
            self._execs.discard(req.rid)
            self._finish(req)
        raise AgentError("exec ended without a reply")

    def kill_all(self) -> None:
        """Kill the process tree of every command running now (a cancel)."""
        for rid in list(self._execs):
            self.call({"op": "kill", "target": rid}, timeout=10.0)

    def _receive(self, message: dict, timeout: float, write: Callable[[bytes], object], max_bytes: int, what: str) -> int:
        """A call whose DATA goes to `write`; a guest sending more than it was allowed is abuse."""
        received = 0

        def take(frame: P.Frame) -> None:
            nonlocal received
            if frame.kind == P.DATA:
                received += len(frame.payload)
                if received > max_bytes:
                    self._abuse(f"the guest sent more than the {max_bytes} bytes allowed for {what}")
                write(frame.payload)

        self.call(message, timeout, on_frame=take)
        return received

    def read_file(self, path: str, max_bytes: int, timeout: float) -> bytes:
        parts: list[bytes] = []
        message = {"op": "read_file", "path": path, "max_bytes": max_bytes}
        self._receive(message, timeout, parts.append, max_bytes, path)
        return b"".join(parts)

    def write_file(self, path: str, chunks: Iterable[bytes], mode: int, timeout: float) -> None:
        self.call({"op": "write_file", "path": path, "mode": mode}, timeout, data=chunks)

    def put_tar(self, dest: str, chunks: Iterable[bytes], timeout: float) -> None:
        self.call({"op": "put_tar", "dest": dest}, timeout, data=chunks)

    def get_tar(self, paths: list[str], cwd: str, out: BinaryIO, max_bytes: int, timeout: float) -> int:
        message = {"op": "get_tar", "paths": paths, "cwd": cwd, "max_bytes": max_bytes}
        return self._receive(message, timeout, out.write, max_bytes, "a tar stream")


class GuestOpError(AgentError):
    """An operation failed inside the guest (a missing file, a bad path): the channel is still fine."""


def _exec_outcome(reply: dict) -> ExecOutcome:
    code = reply.get("exit_code")
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255:
        raise AgentError(f"the guest reported an invalid exit code {code!r}")
    timed_out = reply.get("timed_out")
    killed = reply.get("killed", False)
    if not isinstance(timed_out, bool) or not isinstance(killed, bool):
        raise AgentError("the guest's exec reply has non-boolean flags")
    return ExecOutcome(exit_code=code, timed_out=timed_out, killed=killed)


def _offer(q: queue.Queue, item: object) -> None:
    """Put without blocking: a full queue is drained of one frame to make room for the sentinel."""
    while True:
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            try:
                q.get_nowait()
            except queue.Empty:
                pass
