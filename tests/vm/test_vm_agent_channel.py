"""The host's agent client against a hostile guest: we play the guest on a socketpair.

Each case must end the channel with a clear AgentError, quickly, without hanging the caller or
buffering without bound.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading

import pytest

from runner.vm import guestwire as P
from runner.vm.agent import (
    AgentClient,
    AgentTooOld,
    GuestOpError,
    NotStarted,
    Quiesced,
    QuiesceFailed,
    RequestTooLarge,
)
from runner.vm.errors import AgentError


@pytest.fixture
def pair():
    host, guest = socket.socketpair()
    broken: list[str] = []
    client = AgentClient(host, on_broken=broken.append)
    yield client, guest, broken
    client.close()
    guest.close()
    host.close()


def read_request(guest: socket.socket) -> P.Frame:
    return P.FrameReader(guest.recv).next()


def answer_after_request(guest: socket.socket, payload: bytes) -> None:
    def run() -> None:
        read_request(guest)
        guest.sendall(payload)

    threading.Thread(target=run, daemon=True).start()


def header(kind: int, rid: int, length: int, magic: bytes = P.MAGIC, version: int = P.VERSION) -> bytes:
    return P.HEADER.pack(magic, version, kind, rid, length)


def expect_broken(client: AgentClient, broken: list[str], fragment: str) -> None:
    """The call fails with the protocol error itself: had the client ignored it and waited for its
    deadline, the error would be "did not answer" instead (no clock needed to tell the two apart)."""
    with pytest.raises(AgentError, match=re.escape(fragment)):
        client.ping(timeout=30)
    assert broken and fragment in broken[0]


def wait_broken(client: AgentClient, broken: list[str]) -> str:
    """The reason the channel broke; event-driven, with a generous bound for a loaded machine."""
    assert client.broken_event.wait(30), "the reader never marked the channel broken"
    assert broken and broken[0] == client.broken
    return client.broken


def test_well_formed_reply_is_returned(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode_msg(1, {"ok": True, "version": 1}))
    assert client.ping(timeout=5)["version"] == 1
    assert broken == []


def test_oversized_frame_is_refused_before_reading_it(pair):
    client, guest, broken = pair
    answer_after_request(guest, header(P.STDOUT, 1, 2**31))
    expect_broken(client, broken, "exceeds")


# The limits are pinned as numbers, not read back from guestwire: raising one (or giving every kind
# the data chunk's limit) must fail here, not pass along with the constant it changed.
FRAME_LIMITS = {P.MSG: 64 * 1024, P.STDOUT: 256 * 1024, P.STDERR: 256 * 1024, P.DATA: 256 * 1024, P.END: 256 * 1024}


@pytest.mark.parametrize("kind", sorted(FRAME_LIMITS))
def test_each_kind_has_its_own_frame_limit(kind):
    limit = FRAME_LIMITS[kind]
    assert P.parse_header(header(kind, 1, limit)) == (kind, 1, limit)
    with pytest.raises(P.ProtocolError, match=f"^frame of {limit + 1} bytes exceeds the {limit}-byte limit for kind {kind}$"):
        P.parse_header(header(kind, 1, limit + 1))


def test_a_message_frame_larger_than_a_message_breaks_the_channel(pair):
    """Within the data chunk's limit, yet four times what any JSON message may be."""
    client, guest, broken = pair
    answer_after_request(guest, header(P.MSG, 1, 64 * 1024 + 1))
    expect_broken(client, broken, "frame of 65537 bytes exceeds the 65536-byte limit for kind 1")


def test_bad_magic(pair):
    client, guest, broken = pair
    answer_after_request(guest, header(P.MSG, 1, 2, magic=b"XX") + b"{}")
    expect_broken(client, broken, "bad frame magic")


def test_wrong_version(pair):
    client, guest, broken = pair
    answer_after_request(guest, header(P.MSG, 1, 2, version=9) + b"{}")
    expect_broken(client, broken, "version 9")


def test_unknown_kind(pair):
    client, guest, broken = pair
    answer_after_request(guest, header(77, 1, 0))
    expect_broken(client, broken, "unknown frame kind")


def test_truncated_frame_then_hang_up(pair):
    client, guest, broken = pair

    def run() -> None:
        read_request(guest)
        guest.sendall(header(P.MSG, 1, 100) + b'{"ok"')
        guest.shutdown(socket.SHUT_WR)

    threading.Thread(target=run, daemon=True).start()
    expect_broken(client, broken, "in the middle of a frame")


def test_garbled_json(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode(P.MSG, 1, b"\xff\xfe not json"))
    expect_broken(client, broken, "not valid UTF-8 JSON")


def test_json_that_is_not_an_object(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode(P.MSG, 1, json.dumps([1, 2]).encode()))
    expect_broken(client, broken, "not an object")


def test_reply_to_a_request_never_sent(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode_msg(99, {"ok": True}))
    expect_broken(client, broken, "never sent")


def test_silent_guest_hits_the_deadline(pair):
    client, guest, broken = pair
    with pytest.raises(AgentError, match="did not answer 'ping' within 1 s"):
        client.ping(timeout=1)
    with pytest.raises(AgentError, match="did not answer 'ping' within 1 s"):  # the channel is not trusted again
        client.ping(timeout=30)


def test_guest_that_stops_reading_cannot_block_a_sender(pair):
    client, guest, broken = pair
    big = b"x" * (4 * 1024 * 1024)  # far more than the socket buffers hold
    failed: list[BaseException] = []

    def send() -> None:
        try:
            client.write_file("/tmp/f", [big], mode=0o644, timeout=1)
        except BaseException as exc:  # handed to the test thread
            failed.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(60)  # the call's deadline is 1 s; 60 s only separates "ended" from "blocked for good"
    assert not sender.is_alive(), "a guest that stopped reading blocked the sender past its deadline"
    assert len(failed) == 1 and isinstance(failed[0], AgentError)
    assert re.search("stopped reading|did not answer", str(failed[0]))


def test_invalid_exit_code_is_rejected(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode_msg(1, {"ok": True, "exit_code": 100000, "timed_out": False}))
    with pytest.raises(AgentError, match="invalid exit code"):
        client.exec({"shell": "true"}, lambda s, d: None, timeout=5)


def test_exit_code_of_wrong_type_is_rejected(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode_msg(1, {"ok": True, "exit_code": "0", "timed_out": False}))
    with pytest.raises(AgentError, match="invalid exit code"):
        client.exec({"shell": "true"}, lambda s, d: None, timeout=5)


def test_a_failed_exec_names_the_operation(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode_msg(1, {"ok": False, "error": "cannot start 'nope'"}))
    with pytest.raises(GuestOpError, match="^exec failed in the guest: cannot start 'nope'"):
        client.exec({"argv": ["nope"]}, lambda s, d: None, timeout=5)
    assert broken == []


def test_an_exec_refused_before_it_started_is_told_apart_from_one_that_failed_after(pair):
    """The service starts a shell in place of an argv only when nothing of the argv ran (ATTACK2 finding 1):
    a refusal after the guest said "started", or after any output, is that command's failure, not NotStarted."""
    client, guest, broken = pair
    refusal = {"ok": False, "error": "cannot start 'pytest': No such file or directory"}
    answer_after_request(guest, P.encode_msg(1, refusal))
    with pytest.raises(NotStarted):
        client.exec({"argv": ["pytest"]}, lambda s, d: None, timeout=5)
    answer_after_request(guest, P.encode_msg(2, {"ev": "started", "pid": 7}) + P.encode_msg(2, refusal))
    with pytest.raises(GuestOpError) as after_started:
        client.exec({"argv": ["pytest"]}, lambda s, d: None, timeout=5)
    assert not isinstance(after_started.value, NotStarted)
    answer_after_request(guest, P.encode(P.STDOUT, 3, b"ran\n") + P.encode_msg(3, refusal))
    with pytest.raises(GuestOpError) as after_output:
        client.exec({"argv": ["pytest"]}, lambda s, d: None, timeout=5)
    assert not isinstance(after_output.value, NotStarted)
    assert broken == []


def test_a_request_past_the_agents_message_size_is_refused_before_it_is_sent(pair):
    """A job's command and env can add up past guestwire.MAX_MSG (an env of 128 x 32 KiB is allowed): a clear
    error naming the fix, nothing sent, the channel fine for the next request (it was a raw ValueError)."""
    client, guest, broken = pair
    with pytest.raises(RequestTooLarge, match=r"^exec: the request is \d+ bytes, more than the 65536 .* shorten"):
        client.exec({"argv": ["true"], "env": {"BIG": "x" * P.MAX_MSG}}, lambda s, d: None, timeout=5)
    answer_after_request(guest, P.encode_msg(1, {"ok": True, "ops": []}))  # the refused one took no id
    assert client.ping(timeout=5)["ok"] is True
    assert broken == []


def test_read_file_beyond_the_limit_breaks_the_channel(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode(P.DATA, 1, b"y" * 2000) + P.encode_msg(1, {"ok": True}))
    with pytest.raises(AgentError, match="more than the 1000 bytes"):
        client.read_file("/etc/passwd", max_bytes=1000, timeout=5)
    assert broken


def test_output_flood_is_streamed_with_bounded_buffering(pair):
    """A guest writing far faster than we consume is throttled by the bounded queue, not buffered."""
    client, guest, broken = pair
    chunk = P.encode(P.STDOUT, 1, b"z" * P.MAX_CHUNK)
    total = 200  # 50 MiB in all

    def run() -> None:
        read_request(guest)
        for _ in range(total):
            guest.sendall(chunk)
        guest.sendall(P.encode_msg(1, {"ok": True, "exit_code": 0, "timed_out": False}))

    threading.Thread(target=run, daemon=True).start()
    seen = 0
    max_queued = 0

    def consume(stream: str, data: bytes) -> None:
        nonlocal seen, max_queued
        seen += len(data)
        max_queued = max(max_queued, max(r.frames.qsize() for r in client.channel._pending.values()))

    outcome = client.exec({"shell": "yes"}, consume, timeout=30)
    assert outcome.exit_code == 0
    assert seen == total * P.MAX_CHUNK
    assert max_queued <= 64


def test_stray_frames_for_finished_requests_are_bounded(pair):
    client, guest, broken = pair
    answer_after_request(guest, P.encode_msg(1, {"ok": True}))
    client.ping(timeout=5)
    guest.sendall(P.encode(P.STDOUT, 1, b"late") * 10_001)
    assert "too many frames for requests that already ended" in wait_broken(client, broken)


def test_header_layout_is_what_the_guest_speaks():
    frame = P.encode_msg(7, {"op": "ping"})
    magic, version, kind, rid, length = struct.unpack(">2sBBII", frame[:12])
    assert (magic, version, kind, rid, length) == (b"MV", 1, P.MSG, 7, len(frame) - 12)


# ---- messages that do not decode: the reader must end the channel at once, never die silently ----


def test_deeply_nested_json_breaks_the_channel_at_once(pair):
    client, guest, broken = pair
    nested = b'{"ok":true,"x":' + b"[" * 60_000
    answer_after_request(guest, P.encode(P.MSG, 1, nested))
    with pytest.raises(AgentError, match="nests deeper than 32 levels"):
        client.ping(timeout=30)  # the reply's failure must end the call, not this deadline
    assert "nests deeper than 32 levels" in wait_broken(client, broken)
    with pytest.raises(AgentError, match="nests deeper"):
        client.ping(timeout=1)


def test_unsolicited_nested_json_breaks_an_idle_channel(pair):
    client, guest, broken = pair
    guest.sendall(P.encode(P.MSG, 0, b"[" * 60_000 + b"]" * 4_000))
    assert "the guest agent broke the protocol: message nests deeper" in wait_broken(client, broken)


def test_brackets_inside_strings_are_not_nesting(pair):
    client, guest, broken = pair
    text = "[{" * 5000 + '\\"]' * 10
    answer_after_request(guest, P.encode_msg(1, {"ok": True, "version": 1, "text": text, "deep": [[[[1]]]]}))
    reply = client.ping(timeout=30)
    assert reply["text"] == text and reply["deep"] == [[[[1]]]]
    assert broken == []


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b'{"ok": "yes"}', "member 'ok' is a str, not a boolean"),
        (b'{"ok": true, "n": NaN}', "NaN is not JSON"),
        (b'{"ok": true, "n": ' + b"9" * 5000 + b"}", "integer string conversion"),
        (b'{"ok": true, "s": "\xc3"}', "UnicodeDecodeError"),
    ],
)
def test_every_decoding_error_is_a_protocol_error(pair, payload, reason):
    client, guest, broken = pair
    answer_after_request(guest, P.encode(P.MSG, 1, payload))
    with pytest.raises(AgentError, match=reason):
        client.ping(timeout=30)
    assert reason in wait_broken(client, broken)


def test_an_unforeseen_failure_in_the_reader_still_breaks_the_channel(pair, monkeypatch):
    client, guest, broken = pair

    def explode(payload: bytes) -> dict:
        raise KeyError("unforeseen")

    monkeypatch.setattr("runner.vm.agent.decode_message", explode)
    answer_after_request(guest, P.encode_msg(1, {"ok": True}))
    with pytest.raises(AgentError, match="reader failed: KeyError"):
        client.ping(timeout=30)
    assert "reader failed: KeyError: 'unforeseen'" in wait_broken(client, broken)


def _answer_quiesce(guest: socket.socket, reply: dict, seen: list[dict]) -> None:
    def run() -> None:
        seen.append(read_request(guest).json())
        guest.sendall(P.encode_msg(1, reply))

    threading.Thread(target=run, daemon=True).start()


def test_quiesce_is_an_operation_of_its_own_with_a_typed_answer(pair):
    client, guest, broken = pair
    seen: list[dict] = []
    _answer_quiesce(guest, {"ok": True, "unmounted": 2, "sync_ms": 41.5}, seen)
    assert client.quiesce(timeout=30) == Quiesced(unmounted=2, sync_ms=41.5)
    assert seen == [{"op": P.QUIESCE, "timeout": 30}] and broken == []


@pytest.mark.parametrize("refused", sorted(P.QUIESCE_REFUSALS))
def test_a_refused_quiesce_says_why_and_the_channel_stays(pair, refused):
    client, guest, broken = pair
    _answer_quiesce(guest, {"ok": False, "refused": refused, "error": "1 command(s) still running"}, [])
    with pytest.raises(QuiesceFailed, match="^quiesce failed in the guest: 1 command") as failed:
        client.quiesce(timeout=30)
    assert failed.value.refused == refused and broken == [] and client.broken is None


def test_an_agent_without_quiesce_is_told_apart_from_a_refusal(pair):
    """What every agent baked before the operation answers: the host must say the template is stale."""
    client, guest, broken = pair
    _answer_quiesce(guest, {"ok": False, "error": "unknown op 'quiesce'"}, [])
    with pytest.raises(AgentTooOld) as old:
        client.quiesce(timeout=30)
    assert old.value.op == P.QUIESCE and broken == []


@pytest.mark.parametrize("answer", [
    {"ok": True, "unmounted": 10**9, "sync_ms": 1.0},
    {"ok": True, "unmounted": True, "sync_ms": 1.0},
    {"ok": True, "unmounted": 1, "sync_ms": "fast"},
    {"ok": True, "unmounted": 1, "sync_ms": -1},
    {"ok": True},
])
def test_a_quiesce_answer_out_of_bounds_is_an_error(pair, answer):
    client, guest, broken = pair
    _answer_quiesce(guest, answer, [])
    with pytest.raises(AgentError, match="the guest reported an invalid"):
        client.quiesce(timeout=30)
