"""The job log: live followers, bounded size with an honest note, survival across restarts."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pytest

from runner.service.config.settings import LogLimits
from runner.service.jobs.joblog import JobLog, LogFull


def entries(lines: list[bytes]) -> list[tuple[int, str, bytes]]:
    out = []
    for line in lines:
        obj = json.loads(line)
        out.append((obj["seq"], obj["stream"], base64.b64decode(obj["data"])))
    return out


def test_follow_replays_then_ends_on_close(tmp_path: Path) -> None:
    log = JobLog(tmp_path / "log", LogLimits())
    log.append("stdout", b"one\n")
    log.append("stderr", b"two\n")
    log.system("note")
    log.close()
    assert entries(list(log.follow())) == [(1, "stdout", b"one\n"), (2, "stderr", b"two\n"), (3, "system", b"note")]
    assert entries(list(log.follow(after=2))) == [(3, "system", b"note")]


def test_follower_sees_live_output(tmp_path: Path) -> None:
    log = JobLog(tmp_path / "log", LogLimits())
    seen: list[bytes] = []
    first = threading.Event()

    def follow() -> None:
        for line in log.follow(poll_seconds=0.05):
            seen.append(line)
            first.set()

    reader = threading.Thread(target=follow)
    reader.start()
    log.append("stdout", b"early")
    assert first.wait(10)
    log.append("stdout", b"late")
    log.close()
    reader.join(10)
    assert not reader.is_alive()
    assert [e[2] for e in entries(seen)] == [b"early", b"late"]


def test_flood_stops_at_the_budget_with_a_note(tmp_path: Path) -> None:
    log = JobLog(tmp_path / "log", LogLimits(max_bytes=1000, max_entry_bytes=300))
    with pytest.raises(LogFull, match="reached the log limit of 1000 bytes on disk"):
        for _ in range(50):
            log.append("stdout", b"y" * 100)
    with pytest.raises(LogFull, match=r"^the command's output reached the log limit of 1000 bytes on disk \(logs\.max_bytes\): the command was stopped$"):  # and on every later write: the command must stop
        log.append("stdout", b"z")
    log.close()
    got = entries(list(log.follow()))
    kept = b"".join(data for _, stream, data in got if stream == "stdout")
    assert kept == b"y" * len(kept) and len(kept) >= 400
    assert got[-1][1:] == ("system", b"the command's output reached the log limit of 1000 bytes on disk "
                                     b"(logs.max_bytes): the command was stopped")
    assert log.output_bytes <= 1000


def test_budget_counts_bytes_on_disk_not_guest_bytes(tmp_path: Path) -> None:
    """One-byte entries cost ~70 bytes each on disk: the budget must see those, not the one byte."""
    log = JobLog(tmp_path / "log", LogLimits(max_bytes=10_000))
    with pytest.raises(LogFull, match=r"reached the log limit of 10000 bytes on disk \(logs\.max_bytes\): the command was stopped"):
        for _ in range(10_000):
            log.append("stdout", b"x")
    log.close()
    lines = (tmp_path / "log").read_bytes().splitlines(keepends=True)
    output = sum(len(line) for line in lines if b'"stream":"stdout"' in line)
    assert output == log.output_bytes <= 10_000
    assert (tmp_path / "log").stat().st_size <= 10_000 + len(lines[-1])


def test_large_chunks_are_split(tmp_path: Path) -> None:
    log = JobLog(tmp_path / "log", LogLimits(max_bytes=10**6, max_entry_bytes=1000))
    log.append("stdout", bytes(range(256)) * 10)
    log.close()
    got = entries(list(log.follow()))
    assert [len(d) for _, _, d in got] == [1000, 1000, 560]
    assert b"".join(d for _, _, d in got) == bytes(range(256)) * 10


def test_finished_log_is_readable_after_a_restart(tmp_path: Path) -> None:
    log = JobLog(tmp_path / "log", LogLimits())
    log.append("stdout", b"kept")
    log.close()
    again = JobLog.finished(tmp_path / "log")
    assert entries(list(again.follow())) == [(1, "stdout", b"kept")]
    assert list(JobLog.finished(tmp_path / "missing").follow()) == []


def test_reopened_log_continues_its_sequence(tmp_path: Path) -> None:
    first = JobLog(tmp_path / "log", LogLimits())
    first.append("stdout", b"a")
    first.close()
    second = JobLog(tmp_path / "log", LogLimits())
    second.append("stdout", b"b")
    second.close()
    assert [e[0] for e in entries(list(second.follow()))] == [1, 2]


def test_appends_after_close_are_ignored(tmp_path: Path) -> None:
    log = JobLog(tmp_path / "log", LogLimits())
    log.close()
    log.append("stdout", b"late")
    log.system("late")
    assert list(log.follow()) == []
