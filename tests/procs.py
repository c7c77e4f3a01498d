"""Whether a host process still runs, as the tests that check what a job or a VM left behind ask it.

A zombie counts as gone: it runs nothing, and a killed process whose parent died is init's to
reap, which this machine's init does late. A process reaped between two looks has no /proc entry.
"""

from __future__ import annotations

import time
from pathlib import Path


def runs(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to `timeout` seconds for every process in `pids` to stop running; those still running."""
    deadline = time.monotonic() + timeout
    while (alive := [pid for pid in pids if runs(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive
