"""A real guest writing one byte per system call, into a real job log: bounded disk and host CPU.

The guest agent forwards whatever each pipe read returns, so a program that writes byte by byte,
slowly enough that each read finds one byte, sends one-byte frames; the host must merge them before
they reach the log. (Written without pauses, the guest's own pipe already merges them under TCG.)
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

from runner.sandbox import Sandbox
from runner.service.config.settings import LogLimits
from runner.service.jobs.joblog import JobLog, LogFull

FIXED_OVERHEAD = 64 * 1024
MAX_CPU_PER_BYTE_S = 50e-6  # measured here: ~23 us with a byte every ms (wake-ups dominate), ~150 us before

BYTE_BY_BYTE = """
import os, time
for i in range({n}):
    os.write(1, bytes([48 + i % 10]))
    if i % 500 == 499:
        os.write(2, b"!")
    time.sleep(0.001)
"""


def channel_cpu_seconds(sandbox: Sandbox) -> float:
    """CPU of the two host threads that handle a VM's output: its agent reader and this one (the
    exec, writing the log). The rest of the process (QMP, the reaper) costs per second, not per byte."""
    reader = time.pthread_getcpuclockid(sandbox._vm.agent.channel._reader.ident)
    return time.clock_gettime(reader) + time.thread_time()


def log_output(path: Path) -> dict[str, bytes]:
    out = {"stdout": b"", "stderr": b""}
    for line in path.read_bytes().splitlines():
        entry = json.loads(line)
        if entry["stream"] in out:
            out[entry["stream"]] += base64.b64decode(entry["data"])
    return out


@pytest.fixture
def quiet_sandbox(make_engine):
    """No warm pool refilling in this process while we measure its CPU."""
    with Sandbox.create(engine=make_engine(pool_size=0)) as sbx:
        yield sbx


def test_byte_by_byte_output_is_exact_with_bounded_disk_and_cpu(quiet_sandbox, tmp_path):
    n = 3_000
    log = JobLog(tmp_path / "log", LogLimits())
    before = channel_cpu_seconds(quiet_sandbox)
    result = quiet_sandbox.exec(["python3", "-c", BYTE_BY_BYTE.format(n=n)], on_output=log.append, capture_bytes=0)
    used = channel_cpu_seconds(quiet_sandbox) - before
    log.close()
    guest_bytes = n + n // 500
    assert result.exit_code == 0, result
    expected = bytes(48 + i % 10 for i in range(n))
    assert log_output(tmp_path / "log") == {"stdout": expected, "stderr": b"!" * (n // 500)}
    assert (tmp_path / "log").stat().st_size <= 2 * guest_bytes + FIXED_OVERHEAD
    assert used <= MAX_CPU_PER_BYTE_S * guest_bytes, f"{used / guest_bytes * 1e6:.1f} us of host CPU per guest byte"


def test_output_past_the_log_budget_stops_the_command_and_ends_the_sandbox(quiet_sandbox, tmp_path):
    log = JobLog(tmp_path / "log", LogLimits(max_bytes=64 * 1024))
    with pytest.raises(LogFull, match="log limit of 65536 bytes on disk"):
        quiet_sandbox.exec("yes byte-by-byte", on_output=log.append, timeout_seconds=600, capture_bytes=0)
    assert not quiet_sandbox.alive  # nobody would read its output: the VM is gone, not left running
    log.close()
    kept = log_output(tmp_path / "log")["stdout"]
    assert kept == b"byte-by-byte\n" * (len(kept) // 13) + b"byte-by-byte\n"[: len(kept) % 13]
    assert log.output_bytes <= 64 * 1024
