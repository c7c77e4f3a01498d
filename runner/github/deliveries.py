"""Each webhook delivery is acted on once, and failed deliveries are asked for again.

GitHub does not retry a failed delivery by itself, and it may send a delivery twice (our own
redelivery requests, or a manual one from the App's settings). `DeliveryLog` remembers recent
delivery GUIDs (bounded in count and age, so a flood cannot grow it); `RedeliverySweep` uses the
App's delivery list to redeliver what failed while the service was down or busy.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from runner.github.app import parse_timestamp
from runner.github.client import Clock, GitHubClient
from runner.github.errors import GitHubError

log = logging.getLogger(__name__)


class DeliveryLog:
    """A bounded set of delivery keys (GUIDs, body digests) seen within `ttl` seconds, oldest
    forgotten first."""

    def __init__(self, capacity: int = 10_000, ttl: float = 24 * 3600, clock: Clock = time.monotonic) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def claim_all(self, keys: tuple[str, ...]) -> bool:
        """Claim the keys of one delivery at once: True the first time (the caller processes it),
        False (claiming none) if any of them was seen."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            if any(key in self._seen for key in keys):
                return False
            for key in keys:
                self._seen[key] = now
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)
            return True

    def release_all(self, keys: tuple[str, ...]) -> None:
        """Forget a delivery whose processing failed, so its redelivery is processed."""
        with self._lock:
            for key in keys:
                self._seen.pop(key, None)

    def __len__(self) -> int:
        return len(self._seen)

    def _expire(self, now: float) -> None:
        while self._seen:
            guid, seen_at = next(iter(self._seen.items()))
            if now - seen_at < self.ttl:
                return
            del self._seen[guid]


@dataclass(frozen=True)
class Delivery:
    """One row of `GET /app/hook/deliveries` (GitHub's `hook-delivery-item`)."""

    id: int
    guid: str
    delivered_at: float
    redelivery: bool
    status_code: int
    event: str

    @property
    def succeeded(self) -> bool:
        return 200 <= self.status_code < 300


_GUID = re.compile(r"[A-Za-z0-9-]{1,100}")  # GitHub sends UUIDs
_MAX_ID = 2**63 - 1
_SHOWN = 200  # of a refused record in the log: GitHub's answer is not ours to print whole


def _delivery(item: dict[str, object]) -> Delivery | None:
    """One row of the list, type-checked rather than coerced: `int()` of a float such as 1e400 raises
    OverflowError, and a sweep must skip a record it cannot read, never stop on it."""
    guid, event, redelivery = item.get("guid"), item.get("event", ""), item.get("redelivery", False)
    code = item.get("status_code")
    id_ = _int_within(item.get("id"), 1, _MAX_ID)
    status_code = _int_within(0 if code is None else code, 0, 999)  # none yet: the delivery did not complete
    delivered_at = _delivered_at(item.get("delivered_at"))
    if (id_ is None or status_code is None or delivered_at is None
            or not isinstance(guid, str) or _GUID.fullmatch(guid) is None
            or not isinstance(event, str) or len(event) > 64 or not isinstance(redelivery, bool)):
        shown = repr(item)
        log.warning("ignoring an unreadable webhook delivery record: %s%s", shown[:_SHOWN],
                    "..." if len(shown) > _SHOWN else "")
        return None
    return Delivery(id=id_, guid=guid, delivered_at=delivered_at, redelivery=redelivery,
                    status_code=status_code, event=event)


def _int_within(value: object, low: int, high: int) -> int | None:
    """`value` if it is an int (not a bool) in [low, high], else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high else None


def _delivered_at(stamp: object) -> float | None:
    if not isinstance(stamp, str) or len(stamp) > 64:
        return None
    try:
        return parse_timestamp(stamp)
    except GitHubError:
        return None


class RedeliverySweep:
    """Redeliver failed deliveries younger than `window` that nobody has redelivered yet.

    A GUID counts as handled when any of its deliveries succeeded or any is already a redelivery
    (GitHub keeps the GUID across redeliveries), so a delivery that keeps failing is retried once
    per GUID, not on every sweep.
    """

    def __init__(
        self,
        app_client: GitHubClient,
        *,
        window: float = 3 * 3600,
        max_per_sweep: int = 50,
        clock: Clock = time.time,
    ) -> None:
        self.client = app_client
        self.window = window
        self.max_per_sweep = max_per_sweep
        self.clock = clock
        self._requested: set[str] = set()

    def sweep(self) -> list[int]:
        """One pass; returns the delivery ids it asked GitHub to redeliver."""
        by_guid: dict[str, list[Delivery]] = {}
        for delivery in self._recent():
            by_guid.setdefault(delivery.guid, []).append(delivery)
        # A GUID that has left the window is never redelivered again, so forget it: a long-running
        # service would otherwise keep every failed GUID it ever saw.
        self._requested.intersection_update(by_guid)
        redelivered: list[int] = []
        for guid, deliveries in by_guid.items():
            if len(redelivered) >= self.max_per_sweep:
                break
            if guid in self._requested or any(d.succeeded or d.redelivery for d in deliveries):
                continue
            latest = max(deliveries, key=lambda d: d.delivered_at)
            self.client.post(f"/app/hook/deliveries/{latest.id}/attempts")
            self._requested.add(guid)
            redelivered.append(latest.id)
        return redelivered

    def run(self, stop: threading.Event, interval: float = 300.0) -> None:
        """Sweep every `interval` seconds until `stop` is set; a failed sweep is logged, not fatal."""
        while not stop.wait(interval):
            try:
                ids = self.sweep()
                if ids:
                    log.info("asked GitHub to redeliver %d failed webhook deliveries", len(ids))
            except GitHubError as exc:
                log.warning("webhook redelivery sweep failed: %s", exc)
            except Exception:  # anything else in one answer from GitHub must not end the sweeps for good
                log.exception("webhook redelivery sweep failed; the next one runs in %g s", interval)

    def _recent(self) -> Iterator[Delivery]:
        """Deliveries newest first (GitHub's order), stopping at the first one older than the window."""
        oldest = self.clock() - self.window
        for item in self.client.paginate("/app/hook/deliveries", key=None):
            delivery = _delivery(item) if isinstance(item, dict) else None
            if delivery is None:
                continue
            if delivery.delivered_at < oldest:
                return
            yield delivery
