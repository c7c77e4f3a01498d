"""VMs restored ahead of time, waiting for a job to claim them.

Starting QEMU costs 45-70 ms of every restore (docs/platform.md) and, under TCG, the first answer of a
restored guest another 100-300 ms of code translation. Neither depends on the job, so the pool
pays both in the background: it keeps a few restored, never-used VMs per template variant and
tops them up after each take. A job still gets a VM no one has used; its identity (clock,
entropy, hostname) is given when it takes it (`Engine.create`), and its egress policy right after
(the sandbox layer's network claim).

How many: the configured size is the floor; above it the pool follows demand (`Demand`): the
arrivals expected while one VM is prepared, plus two standard deviations of a Poisson process,
so a burst finds VMs waiting; never more than `cap(snapshot)` (the host's memory). A take that
finds the pool empty while a VM for it is being prepared waits for that one only when it is
expected sooner than a restore of the taker's own (both times measured): a miss costs at most
one restore.

A snapshot whose template is being removed is forgotten (`forget`): its ready VMs are handed back, the
filler at work on it is cancelled and waited for, and nothing is prepared or kept for it again, since
a VM of it would run on deleted files that no take ever asks for.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path

from runner.vm.hypervisor import Snapshot
from runner.vm.vm import VM

log = logging.getLogger(__name__)


class Demand:
    """Takes of one snapshot seen lately and how long preparing a VM for it takes: the pool's target."""

    WINDOW_S = 120.0  # arrivals older than this say nothing about now
    MAX_SEEN = 64

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._arrivals: deque[float] = deque(maxlen=self.MAX_SEEN)
        self.prepare_s: float | None = None  # exponentially weighted mean of the recent prepares
        self.miss_s: float | None = None  # the same for the restores takers did themselves (no rehearsal)
        self.preparing_since: float | None = None  # when the filler began the VM it is preparing now

    def arrived(self) -> None:
        self._arrivals.append(self._clock())

    def prepared(self, seconds: float) -> None:
        self.prepare_s = seconds if self.prepare_s is None else 0.7 * self.prepare_s + 0.3 * seconds

    def missed(self, seconds: float) -> None:
        self.miss_s = seconds if self.miss_s is None else 0.7 * self.miss_s + 0.3 * seconds

    def worth_waiting(self) -> float:
        """How long a take should wait for the VM being prepared: its expected remaining time, if that
        is shorter than restoring one itself would take (0: restore). Unknown times mean: do not wait."""
        if self.preparing_since is None or self.prepare_s is None or self.miss_s is None:
            return 0.0
        remaining = self.prepare_s - (self._clock() - self.preparing_since)
        return remaining if 0 < remaining < self.miss_s else 0.0

    def rate(self) -> float:
        """Arrivals per second over the window (0 with fewer than two)."""
        now = self._clock()
        while self._arrivals and now - self._arrivals[0] > self.WINDOW_S:
            self._arrivals.popleft()
        if len(self._arrivals) < 2:
            return 0.0
        return len(self._arrivals) / max(now - self._arrivals[0], 1e-3)

    def target(self, floor: int, cap: int) -> int:
        """VMs to keep ready: floor <= ceil(m + 2 sqrt(m)) <= cap, m the arrivals during one prepare."""
        if floor <= 0:
            return 0  # no pool configured: every take restores
        expected = self.rate() * (self.prepare_s or 0.0)
        wanted = math.ceil(expected + 2 * math.sqrt(expected)) if expected > 0 else 0
        return max(floor, min(cap, wanted))


class SpareVMs:
    """Restored VMs bound to no job yet, per template variant, refilled after each take (the service's
    `PrewarmedVMs` are another thing: VMs restored for one queued GitHub job, with its policy).

    `size` is the floor per snapshot; `cap(snapshot)` the most the host's memory allows (default: the floor)."""

    def __init__(self, prepare: Callable[[Snapshot], VM], size: int,
                 cap: Callable[[Snapshot], int] | None = None,
                 hurry: Callable[[Snapshot], None] | None = None,
                 cancel: Callable[[Snapshot], None] | None = None) -> None:
        self._prepare = prepare
        self._hurry = hurry or (lambda snapshot: None)  # a take now waits for the VM being prepared
        self._cancel = cancel or (lambda snapshot: None)  # the VM being prepared is for a forgotten snapshot
        self.size = size
        self._cap = cap or (lambda snapshot: size)
        self._ready: dict[Snapshot, list[VM]] = defaultdict(list)
        self._filling: dict[Snapshot, threading.Thread] = {}
        self._demand: dict[Snapshot, Demand] = defaultdict(Demand)
        self._waiting: set[Snapshot] = set()  # snapshots with a take waiting for the VM being prepared
        self._forgotten: set[Snapshot] = set()  # templates being removed: nothing is prepared or kept for them
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self.misses = 0  # takes that found nothing and restored their own VM, since the start (`missed`)

    def target(self, snapshot: Snapshot) -> int:
        """How many VMs of `snapshot` the pool keeps ready now."""
        with self._lock:
            return self._target(snapshot)

    def _target(self, snapshot: Snapshot) -> int:
        return self._demand[snapshot].target(self.size, max(self.size, self._cap(snapshot)))

    def take(self, snapshot: Snapshot) -> VM | None:
        """A ready VM, or None (then the caller restores one). When none is ready but one is being
        prepared, wait for it up to one prepare's time: it is further along than a new restore."""
        with self._lock:
            if snapshot in self._forgotten:
                return None
            self._demand[snapshot].arrived()
        while True:
            with self._lock:
                entries = self._ready.get(snapshot, [])  # not made for a snapshot forgotten meanwhile
                # One filler prepares one VM at a time: one take may wait for it (if it will be ready before
                # a restore of its own would be), others restore their own.
                wait = self._demand[snapshot].worth_waiting() if snapshot in self._filling else 0.0
                if not entries and wait > 0 and snapshot not in self._waiting and not self._closed:
                    self._waiting.add(snapshot)
                    try:
                        self._hurry(snapshot)
                        self._changed.wait_for(lambda: bool(self._ready.get(snapshot)) or snapshot not in self._filling
                                               or self._closed, timeout=wait)
                    finally:
                        self._waiting.discard(snapshot)
                    entries = self._ready.get(snapshot, [])  # close(), an eviction or forget may have replaced it
                if not entries:
                    return None
                vm = entries.pop(0)
            if not vm.destroyed and vm.machine.alive():
                return vm
            vm.destroy()

    def missed(self, snapshot: Snapshot, seconds: float) -> None:
        """A take found nothing and its caller restored a VM itself in `seconds` (what waiting must beat)."""
        with self._lock:
            self.misses += 1
            self._demand[snapshot].missed(seconds)

    def drain(self, snapshot: Snapshot) -> list[VM]:
        """Every VM ready for `snapshot`, taken out for the caller to end (no demand is counted)."""
        with self._lock:
            return self._ready.pop(snapshot, [])

    def forget(self, snapshot: Snapshot) -> list[VM]:
        """`snapshot`'s template is about to be removed: from now on nothing is prepared or kept for it. The
        filler at work on it is cancelled and waited for (it discards what it made), so that when this
        returns no VM of the pool's holds the snapshot's files but those returned, for the caller to end."""
        self._prune_forgotten()
        with self._lock:
            self._forgotten.add(snapshot)
            filler = self._filling.get(snapshot)
        if filler is not None:
            self._cancel(snapshot)
            filler.join()
        with self._lock:
            self._demand.pop(snapshot, None)
            return self._ready.pop(snapshot, [])

    def _prune_forgotten(self) -> None:
        """Drop the forgotten snapshots whose files are gone (their variant directory last): no VM can be
        prepared from them any more, so the set holds only templates still being removed."""
        with self._lock:
            forgotten = list(self._forgotten)
        gone = {snapshot for snapshot in forgotten if not snapshot.state_file.parent.exists()}
        with self._lock:
            self._forgotten -= gone

    def refill(self, snapshot: Snapshot) -> None:
        """Top up the pool for `snapshot` in the background (one filler per snapshot).

        VMs ready for an older build of the same template and variant are ended: after a rebuild
        (a new digest) no one asks for them again.
        """
        with self._lock:
            if snapshot in self._forgotten:
                return
        self._evict_older_builds(snapshot)
        if self.size <= 0:
            return
        with self._lock:
            if (self._closed or snapshot in self._forgotten or snapshot in self._filling
                    or len(self._ready[snapshot]) >= self._target(snapshot)):
                return
            filler = threading.Thread(target=self._fill, args=(snapshot,), name="pool-fill", daemon=True)
            self._filling[snapshot] = filler
            filler.start()  # under the lock: whoever finds it in _filling (close, forget) may join it

    def _evict_older_builds(self, snapshot: Snapshot) -> None:
        lineage = _lineage(snapshot)
        with self._lock:
            stale = [s for s in self._ready if s != snapshot and _lineage(s) == lineage]
            evicted = [vm for s in stale for vm in self._ready.pop(s)]
        for vm in evicted:
            vm.destroy()

    def _fill(self, snapshot: Snapshot) -> None:
        """Prepare VMs until the target is met. The filler leaves `_filling` under the same lock as its
        decision to stop: a take and a refill in between (seen by the refill as "a filler is at work")
        would otherwise leave the pool one short until the next refill."""
        with self._lock:
            demand = self._demand[snapshot]
        try:
            while True:
                with self._lock:
                    if (self._closed or snapshot in self._forgotten
                            or len(self._ready[snapshot]) >= self._target(snapshot)):
                        self._stop_filling(snapshot)
                        return
                    began = demand.preparing_since = demand._clock()
                try:
                    vm = self._prepare(snapshot)
                finally:
                    with self._lock:
                        demand.preparing_since = None
                with self._lock:
                    demand.prepared(demand._clock() - began)
                    if not self._closed and snapshot not in self._forgotten:
                        self._ready[snapshot].append(vm)
                        self._changed.notify_all()
                        continue
                vm.destroy()  # the loop's check ends the filler next
        except Exception as exc:  # a failed top-up only costs the next job the start-up time
            with self._lock:
                cancelled = snapshot in self._forgotten
            if not cancelled:
                log.warning("could not pre-start a VM for %s: %s", snapshot.state_file, exc)
        finally:
            with self._lock:
                if self._filling.get(snapshot) is threading.current_thread():  # not a successor's
                    self._stop_filling(snapshot)

    def _stop_filling(self, snapshot: Snapshot) -> None:
        """Under the lock: this snapshot's filler is done; takes waiting for it stop waiting."""
        self._filling.pop(snapshot, None)
        self._changed.notify_all()

    def idle(self, snapshot: Snapshot) -> bool:
        """No filler is preparing a VM of `snapshot` now (a benchmark's quiet host)."""
        with self._lock:
            return snapshot not in self._filling

    def ready(self) -> dict[str, int]:
        """Spare VMs waiting now, by "<template>/<variant>" (alive or not yet noticed dead): what `status`
        and the metrics count, since these VMs are QEMU processes of their own."""
        counts: dict[str, int] = {}
        with self._lock:
            for snapshot, vms in self._ready.items():
                if vms:
                    directory, variant = _lineage(snapshot)
                    key = f"{directory.name}/{variant}"
                    counts[key] = counts.get(key, 0) + len(vms)
        return counts

    def close(self) -> None:
        """Stop filling, wait for fillers under way (they discard what they spawn) and end the rest."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            fillers = list(self._filling.values())
        for filler in fillers:
            filler.join()
        with self._lock:
            entries = [s for group in self._ready.values() for s in group]
            self._ready.clear()
        for vm in entries:
            vm.destroy()


def _lineage(snapshot: Snapshot) -> tuple[Path, str]:
    """(template directory, variant) of a snapshot, whatever its digest.

    Its files are <templates>/<name>/<digest>/<variant>/state.bin (runner.vm.templates)."""
    variant_dir = snapshot.state_file.parent
    return variant_dir.parent.parent, variant_dir.name
