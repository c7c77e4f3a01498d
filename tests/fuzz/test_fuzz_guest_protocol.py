"""Fuzz the host's side of the guest protocol, playing a hostile guest.

Two targets: the frame reader on its own (`runner.vm.guestwire.FrameReader`, fed a byte stream in
random pieces: every frame it yields is within the limits, anything else is a `ProtocolError`), and the
whole agent client (`runner.vm.agent.AgentClient` on a socketpair: a `ping` whose reply stream is fuzzed
must return a reply or raise `AgentError`, the channel is marked broken with a reason the guest caused,
and the reader never dies of, or logs, an exception it did not foresee).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator

from hypothesis import given
from hypothesis import strategies as st

from runner.vm import guestwire as P
from runner.vm.agent import AgentClient
from runner.vm.errors import AgentError
from tests.fuzz.fuzzing import INPUTS, fuzz

JSON_DOCS = st.one_of(
    st.just({"ok": True, "version": 1}), st.just({"ok": False, "error": "no"}), st.just({"ev": "started"}),
    st.just({"ok": "yes"}), st.just({"ok": None}), st.just([1, 2]), st.just("text"), st.just(7),
    st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8)),
                 lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner,
                                                                                      max_size=3)), max_leaves=10),
)
HOSTILE_PAYLOADS = [
    b"[" * 50000 + b"]" * 10000,  # nesting that recurses in the parser
    b'{"ok": true, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"ok": ' + b"9" * 5000 + b"}",  # past Python's integer-digit limit
    b'{"ok": NaN}', b'{"ok": Infinity}', b'{"ok": true, "s": "\\ud800"}', b'{"ok": true, "ok": false}',
    b"\xff\xfe{}", b"\xef\xbb\xbf{}", b"", b"{", b"null", b'"' + b"a" * 60000 + b'"',
]


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    """One frame, mostly well formed (so the decoders behind the header run), sometimes not."""
    kind = draw(st.sampled_from(sorted(P.KINDS)) | st.integers(0, 255))
    request_id = draw(st.sampled_from([1, 1, 1, 0, 2]) | st.integers(0, 2**32 - 1))
    if kind == P.MSG:
        payload = draw(st.sampled_from(HOSTILE_PAYLOADS) | JSON_DOCS.map(lambda v: json.dumps(v).encode()))
    else:
        payload = draw(st.binary(max_size=64))
    length = len(payload) if draw(st.integers(0, 9)) else draw(st.integers(0, 2**32 - 1))
    magic = P.MAGIC if draw(st.integers(0, 19)) else draw(st.binary(min_size=2, max_size=2))
    version = P.VERSION if draw(st.integers(0, 19)) else draw(st.integers(0, 255))
    return P.HEADER.pack(magic, version, kind, request_id, length) + payload


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """A few frames, then perhaps some bytes flipped or the end cut off."""
    data = bytearray(b"".join(draw(st.lists(frames(), min_size=1, max_size=6))))
    for _ in range(draw(st.integers(0, 3))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


def pieces(data: bytes, cuts: list[int]) -> Iterator[bytes]:
    start = 0
    for cut in sorted(set(cuts)):
        yield data[start:cut]
        start = cut
    yield data[start:]


@fuzz(400)
@given(streams(), st.lists(st.integers(0, 70000), max_size=8))
def test_frame_reader_yields_frames_within_limits_or_a_protocol_error(data: bytes, cuts: list[int]) -> None:
    INPUTS["guest-frames"] += 1
    chunks = [piece for piece in pieces(data, cuts) if piece]
    buffer = bytearray()

    def read(n: int) -> bytes:
        while not buffer and chunks:
            buffer.extend(chunks.pop(0))
        taken = bytes(buffer[:n])
        del buffer[:n]
        return taken

    reader = P.FrameReader(read)
    try:
        while (frame := reader.next()) is not None:
            assert frame.kind in P.KINDS and 0 <= frame.request_id < P.MAX_REQUEST_ID
            assert len(frame.payload) <= (P.MAX_MSG if frame.kind == P.MSG else P.MAX_CHUNK)
    except P.ProtocolError:
        pass


class _Unforeseen(logging.Handler):
    """Records the agent module's error logs: a reader that logs a traceback met an input it did not foresee."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@fuzz(300)
@given(streams())
def test_agent_client_answers_or_breaks_with_a_reason(reply: bytes) -> None:
    INPUTS["guest-agent"] += 1
    died: list[BaseException] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: died.append(args.exc_value)
    unforeseen = _Unforeseen()
    logging.getLogger("runner.vm.agent").addHandler(unforeseen)
    host, guest = socket.socketpair()
    broken: list[str] = []
    client = AgentClient(host, on_broken=broken.append)
    outcome: list[object] = []

    def ping() -> None:
        try:
            outcome.append(client.ping(timeout=30))
        except AgentError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=ping)
    try:
        caller.start()
        P.FrameReader(guest.recv).next()  # the ping request
        guest.sendall(reply)
        guest.shutdown(socket.SHUT_WR)  # the guest hangs up after its reply
        caller.join(60)
        assert not caller.is_alive(), "ping neither answered nor failed after the guest hung up"
    finally:
        client.close()
        guest.close()
        host.close()
        threading.excepthook = previous_hook
        logging.getLogger("runner.vm.agent").removeHandler(unforeseen)
    assert not died, f"the reader thread died: {died[0]!r}"
    assert not unforeseen.records, unforeseen.records[0].getMessage()
    [result] = outcome
    assert isinstance(result, (dict, AgentError))
    if isinstance(result, dict):
        assert result.get("ok") is True
    else:
        assert broken and len(broken[0]) < 4096 and "reader failed" not in broken[0], broken
