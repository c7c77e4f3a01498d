"""The fleet tests' wait: for a condition, or for as long as the service can still make progress.

A fleet whose runners cannot start (runner/fleet/starts.py) would leave every wait for a job to run out
its timeout (900 s for the longest); it reports a crash loop within a few tries instead, and a wait
gives up at once with that reason. The rig's `serve` (conftest.py) notes each service it runs here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SERVING: list[Any] = []  # the ServiceHosts the rig runs now


def crash_loop_reported() -> str | None:
    """What a serving fleet reports while its runners keep ending before they take a job, or None."""
    for host in SERVING:
        loop = host.fleet.crash_loop() if host.fleet is not None else None
        if loop is not None:
            return str(loop["reason"])
    return None


def wait_until(check: Callable[[], Any], timeout: float, what: str, past_crash_loop: bool = False) -> Any:
    """`check()`'s first true value within `timeout` seconds; given up at once, with the fleet's reason,
    when a serving fleet reports that its runners cannot start (unless the wait is `past_crash_loop`:
    for what ends one)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        stuck = None if past_crash_loop else crash_loop_reported()
        if stuck is not None:
            raise AssertionError(f"gave up waiting for {what}: the fleet reports a {stuck}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)
