"""A guest sending its output one byte per frame: the host's disk and CPU stay bounded per byte.

We play the guest on a socketpair (no VM needed): the host side is the real AgentClient feeding a
real JobLog, as a job does. Before, every frame became its own ~70-byte log entry and cost the host
about 50 us of CPU.
"""

from __future__ import annotations

import base64
import json
import resource
import socket
import threading
from pathlib import Path

import pytest

from runner.service.config.settings import LogLimits
from runner.service.jobs.joblog import JobLog, LogFull
from runner.vm import guestwire as P
from runner.vm.agent import COALESCE_BYTES, AgentClient, FrameBudget

DONE = P.encode_msg(1, {"ok": True, "exit_code": 0, "timed_out": False})
FIXED_OVERHEAD = 64 * 1024  # bytes on disk allowed beyond 2 per guest byte
MAX_CPU_PER_BYTE_S = 20e-6  # measured: about 4 us now, about 50 us before; generous for a loaded machine


@pytest.fixture
def channel():
    host, guest = socket.socketpair()
    clients: list[AgentClient] = []

    def make(budget: FrameBudget | None = None) -> tuple[AgentClient, socket.socket]:
        clients.append(AgentClient(host, budget=budget))
        return clients[-1], guest

    yield make
    for client in clients:
        client.close()
    guest.close()
    host.close()


def play_guest(guest: socket.socket, frames: bytes, then: bytes = DONE) -> threading.Thread:
    """After the host's request, send `frames` and then `then` (the exec's reply)."""

    def run() -> None:
        P.FrameReader(guest.recv).next()
        try:
            guest.sendall(frames + then)
        except OSError:
            pass  # the host stopped reading and the test closed the channel

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def one_byte_frames(streams: list[tuple[int, bytes]]) -> bytes:
    return b"".join(P.encode(kind, 1, data[i : i + 1]) for kind, data in streams for i in range(len(data)))


def log_entries(path: Path) -> list[tuple[str, bytes]]:
    return [(e["stream"], base64.b64decode(e["data"])) for e in map(json.loads, path.read_bytes().splitlines())]


def merged(entries: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """Adjacent entries of one stream joined: the order of the streams' turns, with their bytes."""
    out: list[tuple[str, bytes]] = []
    for stream, data in entries:
        if out and out[-1][0] == stream:
            out[-1] = (stream, out[-1][1] + data)
        else:
            out.append((stream, data))
    return out


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread: the reader's and the log writer's
    return usage.ru_utime + usage.ru_stime


def test_one_byte_frames_cost_bounded_disk_and_cpu_per_byte(channel, tmp_path):
    out = bytes(range(256)) * 300  # 76800 frames
    err = b"warning: \xff\x00 odd bytes\n" * 200  # 5400 frames
    turns = [(P.STDOUT, out[:40000]), (P.STDERR, err), (P.STDOUT, out[40000:])]
    frames = one_byte_frames(turns)
    client, guest = channel(FrameBudget(rate=1e9, burst=1e9))  # the cost per frame, not the pacing
    log = JobLog(tmp_path / "log", LogLimits())
    play_guest(guest, frames)
    before = cpu_seconds()
    outcome = client.exec({"shell": "x"}, log.append, timeout=600)
    used = cpu_seconds() - before
    log.close()
    guest_bytes = len(out) + len(err)
    assert outcome.exit_code == 0
    assert merged(log_entries(tmp_path / "log")) == [("stdout", out[:40000]), ("stderr", err), ("stdout", out[40000:])]
    assert (tmp_path / "log").stat().st_size <= 2 * guest_bytes + FIXED_OVERHEAD
    assert used <= MAX_CPU_PER_BYTE_S * guest_bytes, f"{used / guest_bytes * 1e6:.1f} us of host CPU per guest byte"


def test_merged_output_is_bounded_per_call_and_exact(channel):
    client, guest = channel(FrameBudget(rate=1e9, burst=1e9))
    data = bytes(range(251)) * 800
    play_guest(guest, one_byte_frames([(P.STDOUT, data)]))
    calls: list[bytes] = []
    client.exec({"shell": "x"}, lambda stream, chunk: calls.append(chunk), timeout=600)
    assert b"".join(calls) == data
    assert max(map(len, calls)) <= COALESCE_BYTES
    assert len(calls) < len(data) // 100  # merged, not one call per frame


def test_streams_keep_their_order_when_merged(channel):
    client, guest = channel()
    turns = [(P.STDOUT, b"a"), (P.STDERR, b"b"), (P.STDOUT, b"cd"), (P.STDERR, b"e")]
    play_guest(guest, one_byte_frames(turns))
    calls: list[tuple[str, bytes]] = []
    client.exec({"shell": "x"}, lambda stream, chunk: calls.append((stream, chunk)), timeout=600)
    assert merged(calls) == [("stdout", b"a"), ("stderr", b"b"), ("stdout", b"cd"), ("stderr", b"e")]


def test_a_lone_byte_is_delivered_while_the_command_runs(channel):
    """Merging must not hold output back until more comes: live followers see it at once."""
    client, guest = channel()
    seen = threading.Event()
    release = threading.Event()

    def run() -> None:
        P.FrameReader(guest.recv).next()
        guest.sendall(P.encode(P.STDOUT, 1, b"."))
        release.wait(60)
        guest.sendall(DONE)

    threading.Thread(target=run, daemon=True).start()
    calls: list[bytes] = []

    def on_output(stream: str, chunk: bytes) -> None:
        calls.append(chunk)
        seen.set()

    waiter = threading.Thread(target=lambda: client.exec({"shell": "x"}, on_output, timeout=600))
    waiter.start()
    try:
        assert seen.wait(30), "a lone byte was held back while the command ran on"
    finally:
        release.set()
        waiter.join(60)
    assert calls == [b"."]


def test_a_frame_flood_is_paced_by_the_frame_budget(channel):
    """The reader waits as the budget says for every frame, merged or not: a flood costs the host
    at most `rate` frames of work a second. A fake clock that only sleeping moves makes this exact."""
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    client, guest = channel(FrameBudget(rate=1000, burst=100, clock=lambda: now[0], sleep=sleep))
    play_guest(guest, one_byte_frames([(P.STDOUT, b"x" * 5000)]))
    client.exec({"shell": "x"}, lambda stream, chunk: None, timeout=600)
    # 5000 output frames and the reply, 100 of them free: 4.901 s of reading time at 1000 a second.
    assert sum(slept) == pytest.approx(4.901, abs=0.011)
    assert len(slept) < 600 and min(slept) >= 0.005  # paused in batches of about 10 ms, not per frame


def test_frame_budget_lets_a_burst_through_and_refills():
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    budget = FrameBudget(rate=100, burst=50, clock=lambda: now[0], sleep=sleep)
    for _ in range(50):
        budget.take()
    assert slept == []
    now[0] += 0.2  # 20 frames' worth of idle time
    for _ in range(20):
        budget.take()
    assert slept == []
    budget.take()
    assert slept == [pytest.approx(0.01)]


def test_output_past_the_log_budget_stops_the_exec(channel, tmp_path):
    client, guest = channel(FrameBudget(rate=1e9, burst=1e9))
    data = bytes(range(256)) * 400
    play_guest(guest, one_byte_frames([(P.STDOUT, data)]), then=b"")
    log = JobLog(tmp_path / "log", LogLimits(max_bytes=20_000, max_entry_bytes=4096))
    with pytest.raises(LogFull, match="log limit of 20000 bytes on disk"):
        client.exec({"shell": "x"}, log.append, timeout=600)
    log.close()
    entries = log_entries(tmp_path / "log")
    kept = b"".join(d for s, d in entries if s == "stdout")
    assert kept == data[: len(kept)] and len(kept) > 10_000
    assert log.output_bytes <= 20_000
    assert entries[-1] == ("system", b"the command's output reached the log limit of 20000 bytes on disk "
                                     b"(logs.max_bytes): the command was stopped")
