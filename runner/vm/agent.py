"""The host's side of the guest agent channel, written for a guest that may be hostile.

One reader thread turns the byte stream into validated frames and routes them to the request
they belong to; callers wait on their own bounded queue with a deadline. Anything off (a bad
header, an oversized or truncated frame, a reply to a request never sent, silence past a
deadline, a message that does not decode) marks the channel broken: every waiter gets an
`AgentError` and the owner is told, so the VM is destroyed rather than trusted again. Memory use is
bounded by the queue sizes, and a guest that stops reading cannot block a sender past its deadline.

The guest also decides how many frames it sends, and every frame costs the host CPU outside the
VM's budget. So the reader takes frames from the socket in large reads, merges consecutive output
frames of one request into one item (flushed at 64 KiB, after 50 ms, or before any other frame, so
order is kept and live output is late by at most 50 ms), lets a trickle of small reads (from the
second on) gather for those 50 ms instead of waking for each, and reads at most `FrameBudget.rate`
frames a second: past that it stops reading for a moment and the guest's writes back up.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import queue
import re
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

from runner.vm import guestwire as P
from runner.vm.errors import AgentError

QUEUE_FRAMES = 64  # per request: at most 64 x 256 KiB buffered before the reader waits
POLL_S = 0.25
MAX_STRAY_FRAMES = 10_000  # late frames for finished requests tolerated before we call it abuse
KILL_GRACE_S = 10.0  # how long past its timeout a command may take before the host steps in
CTL_TIMEOUT_S = 10.0  # a terminal session's resize, signal, kill and input writes
RECV_SIZE = 256 * 1024  # one read takes many small frames at once
COALESCE_BYTES = 64 * 1024  # output frames of one request are merged up to this size ...
COALESCE_S = 0.05  # ... or this age, so a live follower still sees a lone byte at once
TRICKLE_BYTES = 16 * 1024  # a read smaller than this while merging: wait for the merge to be due
MAX_FRAMES_PER_S = 20_000  # per channel (one VM): bounds the host CPU a frame flood can take
MAX_JSON_DEPTH = 32  # our messages nest 2 levels; deeper would only exercise the parser's recursion
# What a guest that broke the protocol did, for the engine's count (runner.vm.engine.Engine.protocol_errors):
# a bad frame (header, size, truncation, a request never sent), a message that does not decode, a flood of
# frames for requests that already ended.
FRAME, DECODE, FLOOD = "frame", "decode", "flood"
PROTOCOL_ERROR_KINDS = (FRAME, DECODE, FLOOD)

log = logging.getLogger(__name__)

# A message the guest sent, decoded: a JSON object whose members nobody has checked yet, so each
# use must look at what it got (`object`, not `Any`: the type checker holds us to that).
GuestMessage = dict[str, object]
# A request we send: any JSON object (read-only here, so a dict of narrower values fits too).
HostMessage = Mapping[str, object]


@dataclass
class ExecOutcome:
    exit_code: int
    timed_out: bool
    killed: bool


@dataclass(frozen=True)
class Quiesced:
    """The guest's answer to `quiesce`: how many of the checkout's mounts it unmounted, and how long
    writing and dropping its page cache took."""

    unmounted: int
    sync_ms: float


class _Request:
    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.frames: queue.Queue[P.Frame | None] = queue.Queue(maxsize=QUEUE_FRAMES)  # None: the channel broke
        self.abandoned = False


OUTPUT_KINDS = frozenset({P.STDOUT, P.STDERR})


class _Violation(P.ProtocolError):
    """A ProtocolError raised on this side, with its kind; one from guestwire (a bad header) is a FRAME."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class _Message(P.Frame):
    """A MSG frame decoded once, in the reader, so a bad one breaks the channel there and then."""

    message: GuestMessage = field(default_factory=dict)

    def json(self) -> GuestMessage:
        return self.message


# A JSON string (escapes included) or one bracket: enough to measure nesting without parsing.
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


def _check_depth(payload: bytes) -> None:
    """Refuse nesting deeper than MAX_JSON_DEPTH before `json` recurses into it."""
    if payload.count(b"[") + payload.count(b"{") <= MAX_JSON_DEPTH:
        return  # cannot be deeper: the common case costs two C scans
    depth = 0
    for token in _JSON_TOKEN.finditer(payload):
        if token.group() in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise _Violation(DECODE, f"message nests deeper than {MAX_JSON_DEPTH} levels")
        elif token.group() in (b"]", b"}"):
            depth -= 1


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def decode_message(payload: bytes) -> GuestMessage:
    """A guest MSG as a dict, or ProtocolError: whatever the bytes, no other exception escapes."""
    _check_depth(payload)
    try:
        value = json.loads(payload.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
        raise _Violation(DECODE, f"message is not valid UTF-8 JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(value, dict):
        raise _Violation(DECODE, f"message is a JSON {type(value).__name__}, not an object")
    if "ok" in value and not isinstance(value["ok"], bool):
        raise _Violation(DECODE, f"message member 'ok' is a {type(value['ok']).__name__}, not a boolean")
    return value


@dataclass
class FrameBudget:
    """A token bucket on frames read: past `rate` a second (after a burst) the reader pauses.

    Pausing, not failing: the guest's writes back up, and an honest program's small writes then
    reach its agent's pipe reader together and travel as fewer, larger frames, so chatty programs
    (pytest -v, pip's progress) lose nothing, while a guest forging tiny frames gets a bounded
    share of the host's CPU however long it keeps at it.
    """

    rate: float = MAX_FRAMES_PER_S
    burst: float = MAX_FRAMES_PER_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    tokens: float = -1.0  # -1: start full
    stamp: float = 0.0

    def take(self) -> None:
        """Account for one frame, first waiting as long as the bucket says (in 10 ms steps or more)."""
        now = self.clock()
        self.tokens = self.burst if self.tokens < 0 else min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            refill = max(1.0, self.rate / 100)  # sleep for a batch, not once per frame
            self.sleep((refill - self.tokens) / self.rate)
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
        self.tokens -= 1


class _Wire:
    """Frames out of the socket with one `recv` for many of them; headers checked as soon as read."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._buf = b""
        self._pos = 0

    def frame(self) -> P.Frame | None:
        """The next whole frame already received, or None when more bytes are needed."""
        start = self._pos + P.HEADER.size
        if len(self._buf) < start:
            return None
        kind, rid, length = P.parse_header(self._buf[self._pos : start])
        if len(self._buf) < start + length:
            return None
        self._pos = start + length
        return P.Frame(kind, rid, self._buf[start : self._pos])

    def fill(self, timeout: float) -> int | None:
        """Receive more: the bytes received, None when `timeout` passed first, 0 at the end of the stream."""
        self._buf, self._pos = self._buf[self._pos :], 0
        # Wait with poll, not the socket's timeout: that one is shared with the senders.
        if not self._poll.poll(timeout * 1000):
            return None
        try:
            chunk = self._sock.recv(RECV_SIZE)
        except socket.timeout:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            if self._buf:
                raise P.ProtocolError(f"channel closed in the middle of a frame ({len(self._buf)} bytes of it)")
            return 0
        self._buf += chunk
        return len(chunk)


@dataclass
class _Run:
    """Consecutive output frames of one request, merged into one queue item."""

    req: _Request
    kind: int
    started: float
    parts: list[bytes]
    size: int = 0

    def frame(self) -> P.Frame:
        return P.Frame(self.kind, self.req.rid, b"".join(self.parts))


class AgentChannel:
    """The channel itself, apart from what is asked over it: the reader thread that frames the guest's
    bytes and routes them to their requests, a request's frames out under a deadline, and the breaking
    of the channel that every waiter and the owner hear of."""

    def __init__(
        self,
        sock: socket.socket,
        on_broken: Callable[[str], None] | None = None,
        budget: FrameBudget | None = None,
        on_protocol_error: Callable[[str], None] | None = None,
    ) -> None:
        """`on_protocol_error` hears the kind (FRAME, DECODE, FLOOD) when a protocol error is what broke
        the channel, just before `on_broken` hears the reason; neither is called after `close()`."""
        self._sock = sock
        self._sock.settimeout(POLL_S)
        self._on_broken = on_broken
        self._on_protocol_error = on_protocol_error
        self._budget = budget or FrameBudget()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._issued = 0
        self._pending: dict[int, _Request] = {}
        self._stray = 0
        self._run: _Run | None = None
        self.broken: str | None = None
        self.broken_event = threading.Event()
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name="agent-reader", daemon=True)
        self._reader.start()

    def close(self) -> None:
        self._closed = True
        self.fail("the sandbox was destroyed")

    def _read_loop(self) -> None:
        """Never ends silently: whatever stops it marks the channel broken, with the reason."""
        try:
            self._read_frames(_Wire(self._sock))
        except P.ProtocolError as exc:
            self.fail(f"the guest agent broke the protocol: {exc}", getattr(exc, "kind", FRAME))
        except Exception as exc:  # a bug of ours, or an input we did not foresee: still the guest's doing
            log.exception("agent channel reader failed")
            self.fail(f"the agent channel's reader failed: {type(exc).__name__}: {exc}")
        else:
            self.fail("the guest closed its agent channel")

    def _read_frames(self, wire: _Wire) -> None:
        trickling = False
        while not self._closed:
            frame = wire.frame()
            if frame is not None:
                self._budget.take()
                self._route(frame)
                continue
            if trickling and self._run is not None:
                # Output is dribbling in and would wake us for every write (a wake-up costs far more
                # than the bytes it brings): let it gather until the merged output is due anyway.
                time.sleep(self._flush_due())
            merging = self._run is not None
            received = wire.fill(self._flush_due())
            if received == 0:
                return
            # A trickle is a second small read while output waits: after the first, a read wakes for
            # what follows at once, so output that a command prints as it ends is not held back from
            # the exit reply close behind it (a job whose last line came just before its end finished up to 50 ms late).
            trickling = merging and received is not None and received < TRICKLE_BYTES
            if self._run is not None and (received is None or self._run_expired()):
                self._flush_run()

    def _flush_due(self) -> float:
        """How long the next read may wait: until the merged output is due, or a poll interval."""
        if self._run is None:
            return POLL_S
        return max(0.001, self._run.started + COALESCE_S - time.monotonic())

    def _run_expired(self) -> bool:
        return self._run is not None and time.monotonic() - self._run.started >= COALESCE_S

    def _route(self, frame: P.Frame) -> None:
        run = self._run
        if run is not None:
            if frame.kind == run.kind and frame.request_id == run.req.rid and run.size + len(frame.payload) <= COALESCE_BYTES:
                run.parts.append(frame.payload)
                run.size += len(frame.payload)
                if self._run_expired():
                    self._flush_run()
                return
            self._flush_run()
        if frame.kind == P.MSG:
            frame = _Message(frame.kind, frame.request_id, frame.payload, decode_message(frame.payload))
        with self._lock:
            req = self._pending.get(frame.request_id)
            if req is None:
                if frame.request_id == 0 or frame.request_id > self._issued:
                    raise P.ProtocolError(f"frame for request {frame.request_id}, which was never sent")
                self._stray += 1
                if self._stray > MAX_STRAY_FRAMES:
                    raise _Violation(FLOOD, "too many frames for requests that already ended")
                return
        if frame.kind in OUTPUT_KINDS and len(frame.payload) < COALESCE_BYTES:
            self._run = _Run(req, frame.kind, time.monotonic(), [frame.payload], len(frame.payload))
            return
        self._deliver(req, frame)

    def _flush_run(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            self._deliver(run.req, run.frame())

    def _deliver(self, req: _Request, frame: P.Frame) -> None:
        while not req.abandoned:
            try:
                req.frames.put(frame, timeout=POLL_S)
                return
            except queue.Full:
                if self._closed:
                    return

    def fail(self, why: str, protocol_error: str | None = None) -> None:
        """Break the channel; the first reason wins, and only that one is reported to the owner. A protocol
        error is reported before any waiter wakes, so whoever sees the channel broken sees it counted."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = why
            pending = list(self._pending.values())
        if protocol_error is not None and self._on_protocol_error is not None and not self._closed:
            _tell(self._on_protocol_error, protocol_error)
        self.broken_event.set()
        for req in pending:
            _offer(req.frames, None)
        if self._on_broken is not None and not self._closed:
            _tell(self._on_broken, why)

    def abuse(self, why: str) -> None:
        """The guest ignored a limit it was told: stop trusting the channel."""
        self.fail(why)
        raise AgentError(why)

    def send(self, data: bytes, deadline: float) -> None:
        with self._send_lock:
            view = memoryview(data)
            while view:
                if self.broken:
                    raise AgentError(self.broken)
                try:
                    view = view[self._sock.send(view) :]
                except socket.timeout:
                    if time.monotonic() > deadline:
                        self.fail("the guest stopped reading its agent channel")
                        raise AgentError(self.broken) from None
                except OSError as exc:
                    self.fail(f"the agent channel failed: {exc}")
                    raise AgentError(self.broken) from None

    # ---- one request's frames --------------------------------------------------------------
    def open(self, message: HostMessage, deadline: float) -> _Request:
        data = _encoded(message)  # before the request exists: one too large for the wire leaves nothing behind
        with self._lock:
            if self.broken:
                raise AgentError(self.broken)
            rid = next(self._ids)
            self._issued = rid
            req = _Request(rid)
            self._pending[rid] = req
        self.send(P.encode(P.MSG, rid, data), deadline)
        return req

    def finish(self, req: _Request) -> None:
        req.abandoned = True
        with self._lock:
            self._pending.pop(req.rid, None)
        while True:  # let a reader blocked on this queue go
            try:
                req.frames.get_nowait()
            except queue.Empty:
                return

    def frames(self, req: _Request, deadline: float | None) -> Iterator[P.Frame]:
        """Frames of one request up to its final reply, which is yielded last."""
        while True:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise TimeoutError
            try:
                frame = req.frames.get(timeout=min(wait, POLL_S) if wait is not None else POLL_S)
            except queue.Empty:
                continue
            if frame is None:
                raise AgentError(self.broken or "agent channel broken")
            yield frame
            if frame.kind == P.MSG and "ok" in frame.json():
                return

    def send_data(self, req: _Request, chunks: Iterable[bytes], deadline: float) -> None:
        for chunk in chunks:
            for start in range(0, len(chunk), P.MAX_CHUNK):
                self.send(P.encode(P.DATA, req.rid, chunk[start : start + P.MAX_CHUNK]), deadline)
        self.send(P.encode(P.END, req.rid), deadline)


class AgentClient:
    """The guest agent's operations (exec, terminal sessions, files, quiesce...) over one AgentChannel: what
    each asks, and what of the guest's answer is believed."""

    def __init__(
        self,
        sock: socket.socket,
        on_broken: Callable[[str], None] | None = None,
        budget: FrameBudget | None = None,
        on_protocol_error: Callable[[str], None] | None = None,
    ) -> None:
        """The listeners are the channel's (AgentChannel)."""
        self.channel = AgentChannel(sock, on_broken, budget, on_protocol_error)
        self._execs: set[int] = set()  # the requests of commands running now, for kill_all

    def close(self) -> None:
        self.channel.close()

    @property
    def broken(self) -> str | None:
        """Why the channel broke (the first reason), or None while it works."""
        return self.channel.broken

    @property
    def broken_event(self) -> threading.Event:
        """Set once the channel broke."""
        return self.channel.broken_event

    # ---- requests --------------------------------------------------------------------------
    def call(
        self,
        message: HostMessage,
        timeout: float,
        data: Iterable[bytes] | None = None,
        on_frame: Callable[[P.Frame], None] | None = None,
    ) -> GuestMessage:
        """Send a request (and its data), hand intermediate frames to `on_frame`, return the reply."""
        deadline = time.monotonic() + timeout
        req = self.channel.open(message, deadline)
        try:
            if data is not None:
                self.channel.send_data(req, data, deadline)
            for frame in self.channel.frames(req, deadline):
                if frame.kind == P.MSG and "ok" in frame.json():
                    return self._check(message, frame.json())
                if on_frame is not None:
                    on_frame(frame)
            raise AgentError("request ended without a reply")  # unreachable by construction of AgentChannel.frames
        except TimeoutError:
            self.channel.fail(f"the guest agent did not answer {message.get('op')!r} within {timeout:.0f} s")
            raise AgentError(self.channel.broken) from None
        finally:
            self.channel.finish(req)

    @classmethod
    def _check(cls, message: HostMessage, reply: GuestMessage) -> GuestMessage:
        if reply.get("ok") is True:
            return reply
        raise GuestOpError(cls._failure(message, reply), reply)

    @staticmethod
    def _failure(message: HostMessage, reply: GuestMessage) -> str:
        error = str(reply.get("error", "no reason given"))[:2000]
        return f"{message.get('op')} failed in the guest: {error}"

    # ---- operations ------------------------------------------------------------------------
    def ping(self, timeout: float = 10.0) -> GuestMessage:
        return self.call({"op": "ping"}, timeout)

    def identity(self, hostname: str, vm_id: str, timeout: float = 10.0) -> None:
        seed = base64.b64encode(os.urandom(64)).decode()
        message = {"op": "identity", "time_ns": time.time_ns(), "seed": seed, "hostname": hostname, "vm_id": vm_id}
        self.call(message, timeout)

    def exec(
        self,
        message: HostMessage,
        on_output: Callable[[str, bytes], None],
        timeout: float | None,
        stdin: Iterable[bytes] | None = None,
    ) -> ExecOutcome:
        """Run a command; output goes to `on_output` as it arrives. The host enforces the timeout too.
        `stdin` (bounded by the caller) is the command's whole input: the guest has it before the command starts."""
        limit = timeout + KILL_GRACE_S if timeout is not None else 7 * 24 * 3600.0
        deadline = time.monotonic() + limit
        message = {**message, "op": "exec", "timeout": timeout, **({"stdin": True} if stdin is not None else {})}
        req = self.channel.open(message, deadline)
        self._execs.add(req.rid)
        started = False  # the guest's {"ev": "started"}: past it, a failure is not "could not start"
        try:
            if stdin is not None:
                self.channel.send_data(req, stdin, deadline)
            for frame in self.channel.frames(req, deadline):
                if frame.kind in (P.STDOUT, P.STDERR):
                    started = True  # output comes from a started program, whatever the guest says
                    on_output("stdout" if frame.kind == P.STDOUT else "stderr", frame.payload)
                elif frame.kind == P.MSG and "ok" in frame.json():
                    if frame.json().get("ok") is not True and not started:
                        raise NotStarted(self._failure(message, frame.json()), frame.json())
                    return _exec_outcome(self._check(message, frame.json()))
                elif frame.kind == P.MSG and frame.json().get("ev") == "started":
                    started = True
        except TimeoutError:
            self.channel.fail(f"the guest did not end the command {KILL_GRACE_S:.0f} s after its timeout")
            raise AgentError(self.channel.broken) from None
        finally:
            self._execs.discard(req.rid)
            self.channel.finish(req)
        raise AgentError("exec ended without a reply")

    def pty(self, argv: list[str], cwd: str, env: Mapping[str, str], size: tuple[int, int], timeout: float,
            user: str | None = None) -> GuestPty:
        """Start `argv` on a terminal of its own in the guest (rows x cols `size`), ended by the guest past
        `timeout`; the caller streams it through the GuestPty and must close it. A program that cannot
        start is a NotStarted here."""
        deadline = time.monotonic() + timeout + KILL_GRACE_S
        message = {"op": "pty", "argv": list(argv), "cwd": cwd, "env": dict(env), "rows": size[0], "cols": size[1],
                   "timeout": timeout, "user": user}
        req = self.channel.open(message, deadline)
        session = GuestPty(self, req, deadline)
        try:
            session.wait_started(message)
        except BaseException:
            session.close()
            raise
        return session

    def quiesce(self, timeout: float) -> Quiesced:
        """Make the guest fit to be snapshotted (guestwire's QUIESCE: the checkout unmounted, the page
        cache written and dropped) within `timeout`; the host waits a grace longer, so the guest's own
        refusal (QuiesceFailed, the VM runs on) comes before the host gives up on the channel. An agent
        that does not know the operation is one baked before it existed: AgentTooOld."""
        message = {"op": P.QUIESCE, "timeout": timeout}
        try:
            reply = self.call(message, timeout + KILL_GRACE_S)
        except GuestOpError as exc:
            if exc.reply.get("error") == P.unknown_op(P.QUIESCE):
                raise AgentTooOld(P.QUIESCE) from None
            refused = exc.reply.get("refused")
            known = refused if isinstance(refused, str) and refused in P.QUIESCE_REFUSALS else None
            raise QuiesceFailed(str(exc), known) from None
        return _quiesced(reply)

    def kill_all(self) -> None:
        """Kill the process tree of every command running now (a cancel)."""
        for rid in list(self._execs):
            self.call({"op": "kill", "target": rid}, timeout=10.0)

    def _receive(self, message: HostMessage, timeout: float, write: Callable[[bytes], object], max_bytes: int, what: str) -> int:
        """A call whose DATA goes to `write`; a guest sending more than it was allowed is abuse."""
        received = 0

        def take(frame: P.Frame) -> None:
            nonlocal received
            if frame.kind == P.DATA:
                received += len(frame.payload)
                if received > max_bytes:
                    self.channel.abuse(f"the guest sent more than the {max_bytes} bytes allowed for {what}")
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


class GuestPty:
    """One terminal session in the guest (`AgentClient.pty`): typed input in, the terminal's output out,
    resized and signalled by name (guestwire's PTY_SIGNALS), its exit status once it has ended.

    `output()` and `close()` belong to one thread; `write`, `resize`, `signal` and `end` may come from
    others. `close` ends the session in the guest (its process tree killed) unless it has ended already,
    and ends the host's input stream, which the guest reads to its end whatever happened."""

    def __init__(self, client: AgentClient, req: _Request, deadline: float) -> None:
        self._client = client
        self._req = req
        self._deadline = deadline
        self._lock = threading.Lock()
        self._input_ended = False
        self.outcome: ExecOutcome | None = None
        self.input_dropped = 0
        client._execs.add(req.rid)

    @property
    def rid(self) -> int:
        return self._req.rid

    def wait_started(self, message: HostMessage) -> None:
        """Until the guest says the program started, or why it did not (NotStarted)."""
        for frame in self._client.channel.frames(self._req, self._deadline):
            if frame.kind == P.MSG and frame.json().get("ev") == "started":
                return
            if frame.kind == P.MSG and "ok" in frame.json():
                reply = frame.json()
                raise NotStarted(AgentClient._failure(message, reply), reply)
        raise AgentError("pty ended without a reply")

    def output(self) -> Iterator[bytes]:
        """The terminal's output as it comes, until the program has ended (then `outcome` is set)."""
        try:
            for frame in self._client.channel.frames(self._req, self._deadline):
                if frame.kind == P.STDOUT:
                    yield frame.payload
                elif frame.kind == P.MSG and "ok" in frame.json():
                    reply = AgentClient._check({"op": "pty"}, frame.json())
                    dropped = reply.get("input_dropped", 0)
                    self.input_dropped = dropped if isinstance(dropped, int) and not isinstance(dropped, bool) else 0
                    self.outcome = _exec_outcome(reply)
                    return
        except TimeoutError:
            self._client.channel.fail(f"the guest did not end a terminal session {KILL_GRACE_S:.0f} s after its timeout")
            raise AgentError(self._client.broken) from None

    def write(self, data: bytes) -> None:
        """Typed input (the guest holds at most guestwire.PTY_INPUT_MAX of it unread; more is dropped there)."""
        with self._lock:
            if self._input_ended:
                return
            for start in range(0, len(data), P.MAX_CHUNK):
                self._client.channel.send(P.encode(P.DATA, self.rid, data[start : start + P.MAX_CHUNK]), self._send_deadline())

    def resize(self, rows: int, cols: int) -> bool:
        """The terminal's new size (the program gets SIGWINCH); False once the session has ended."""
        if self._closed():
            return False
        reply = self._client.call({"op": "pty_ctl", "target": self.rid, "rows": rows, "cols": cols}, CTL_TIMEOUT_S)
        return reply.get("found") is True

    def signal(self, name: str) -> bool:
        """A signal (a name of guestwire's PTY_SIGNALS) to the terminal's foreground process group."""
        if name not in P.PTY_SIGNALS:
            raise ValueError(f"no signal {name!r}: one of {', '.join(sorted(P.PTY_SIGNALS))}")
        if self._closed():
            return False
        reply = self._client.call({"op": "pty_ctl", "target": self.rid, "signal": name}, CTL_TIMEOUT_S)
        return reply.get("found") is True

    def end(self) -> None:
        """Kill the session's process tree in the guest (from any thread): `output()` then ends."""
        if self.outcome is None and not self._client.broken:
            self._client.call({"op": "kill", "target": self.rid}, CTL_TIMEOUT_S)

    def close(self) -> None:
        """By the thread that read `output()`, once done with it: the session ended (`end`) and the input
        stream with it; idempotent."""
        client = self._client
        try:
            self.end()
            with self._lock:
                if not self._input_ended and not client.broken:
                    client.channel.send(P.encode(P.END, self.rid), self._send_deadline())
                self._input_ended = True
        finally:
            client._execs.discard(self.rid)
            client.channel.finish(self._req)

    def _closed(self) -> bool:
        """Ended as far as this side knows: closed here (the guest drops a killed session only once it has
        reaped it, a moment later, and a resize meanwhile would still find it) or its exit has come."""
        with self._lock:
            return self._input_ended or self.outcome is not None

    def _send_deadline(self) -> float:
        return time.monotonic() + CTL_TIMEOUT_S


class GuestOpError(AgentError):
    """An operation failed inside the guest (a missing file, a bad path): the channel is still fine.
    `reply` is the guest's answer as it came (untrusted: read it member by member)."""

    def __init__(self, message: str, reply: GuestMessage | None = None) -> None:
        super().__init__(message)
        self.reply: GuestMessage = reply if reply is not None else {}


class QuiesceFailed(GuestOpError):
    """The guest could not be made fit for a snapshot: `refused` is one of guestwire's QUIESCE_REFUSALS
    (a command still running, the checkout held, the sync too slow), or None for another failure. The
    VM runs on."""

    def __init__(self, message: str, refused: str | None) -> None:
        super().__init__(message)
        self.refused = refused


class RequestTooLarge(GuestOpError):
    """A request past the guest agent's message size (guestwire.MAX_MSG), refused before anything was sent:
    the channel is fine, and for an exec nothing started."""


def _encoded(message: HostMessage) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > P.MAX_MSG:
        raise RequestTooLarge(f"{message.get('op')}: the request is {len(data)} bytes, more than the {P.MAX_MSG} the "
                              "guest agent takes in one message: shorten the command or its env (large values can "
                              "go in a file of the checkout)")
    return data


class NotStarted(GuestOpError):
    """An exec refused before its program started (the guest sent no "started" and no output)."""


class AgentTooOld(GuestOpError):
    """The guest's agent answered "unknown op": its template was baked before the operation existed."""

    def __init__(self, op: str) -> None:
        super().__init__(f"the guest agent does not know the operation {op!r}")
        self.op = op


def _quiesced(reply: GuestMessage) -> Quiesced:
    unmounted, sync_ms = reply.get("unmounted"), reply.get("sync_ms")
    if not isinstance(unmounted, int) or isinstance(unmounted, bool) or not 0 <= unmounted <= 64:
        raise AgentError(f"the guest reported an invalid count of unmounted checkout mounts: {str(unmounted)[:40]!r}")
    if not isinstance(sync_ms, (int, float)) or isinstance(sync_ms, bool) or not 0 <= sync_ms < 1e9:
        raise AgentError(f"the guest reported an invalid sync time: {str(sync_ms)[:40]!r}")
    return Quiesced(unmounted=unmounted, sync_ms=float(sync_ms))


def _exec_outcome(reply: GuestMessage) -> ExecOutcome:
    code = reply.get("exit_code")
    if not isinstance(code, int) or isinstance(code, bool) or not 0 <= code <= 255:
        raise AgentError(f"the guest reported an invalid exit code {code!r}")
    timed_out = reply.get("timed_out")
    killed = reply.get("killed", False)
    if not isinstance(timed_out, bool) or not isinstance(killed, bool):
        raise AgentError("the guest's exec reply has non-boolean flags")
    return ExecOutcome(exit_code=code, timed_out=timed_out, killed=killed)


def _tell(listener: Callable[[str], None], what: str) -> None:
    """Call the owner's listener: its failing (a cleanup that fails) must not hide that the channel broke."""
    try:
        listener(what)
    except Exception:
        log.exception("handling the broken agent channel failed")


def _offer(q: queue.Queue[P.Frame | None], item: P.Frame | None) -> None:
    """Put without blocking: a full queue is drained of one frame to make room for the None that says the channel broke."""
    while True:
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            try:
                q.get_nowait()
            except queue.Empty:
                pass
