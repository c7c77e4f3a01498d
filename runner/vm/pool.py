"""VMMs started ahead of time and waiting for a snapshot to restore.

Starting QEMU costs 45-70 ms of every restore (PLATFORM.md); a process started with
`-incoming defer` can wait for its job indefinitely at almost no cost, so the pool keeps a few
per template variant and tops them up in the background after each take.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner.vm.hypervisor import Machine, Snapshot

log = logging.getLogger(__name__)


@dataclass
class Spawned:
    vm_id: str
    vm_dir: Path
    machine: Machine
    slot: object | None

    def discard(self, release_slot: Callable[[object], None] | None) -> None:
        import shutil

        self.machine.kill()
        if self.slot is not None and release_slot is not None:
            release_slot(self.slot)
        shutil.rmtree(self.vm_dir, ignore_errors=True)


class WarmPool:
    def __init__(self, spawn: Callable[[Snapshot], Spawned], size: int, release_slot=None) -> None:
        self._spawn = spawn
        self.size = size
        self._release_slot = release_slot
        self._ready: dict[Snapshot, list[Spawned]] = defaultdict(list)
        self._filling: dict[Snapshot, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, snapshot: Snapshot) -> Spawned | None:
        while True:
            with self._lock:
                entries = self._ready[snapshot]
                if not entries:
                    return None
                spawned = entries.pop(0)
            if spawned.machine.alive():
                return spawned
            spawned.discard(self._release_slot)

    def refill(self, snapshot: Snapshot) -> None:
        """Top up the pool for `snapshot` in the background (one filler per snapshot)."""
        if self.size <= 0:
            return
        with self._lock:
            if self._closed or snapshot in self._filling or len(self._ready[snapshot]) >= self.size:
                return
            filler = threading.Thread(target=self._fill, args=(snapshot,), name="pool-fill", daemon=True)
            self._filling[snapshot] = filler
        filler.start()

    def _fill(self, snapshot: Snapshot) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._ready[snapshot]) >= self.size:
                        return
                spawned = self._spawn(snapshot)
                with self._lock:
                    if self._closed:
                        spawned.discard(self._release_slot)
                        return
                    self._ready[snapshot].append(spawned)
        except Exception as exc:  # a failed top-up only costs the next job the start-up time
            log.warning("could not pre-start a VM for %s: %s", snapshot.state_file, exc)
        finally:
            with self._lock:
                self._filling.pop(snapshot, None)

    def close(self) -> None:
        """Stop filling, wait for fillers under way (they discard what they spawn) and end the rest."""
        with self._lock:
            self._closed = True
            fillers = list(self._filling.values())
        for filler in fillers:
            filler.join()
        with self._lock:
            entries = [s for group in self._ready.values() for s in group]
            self._ready.clear()
        for spawned in entries:
            spawned.discard(self._release_slot)
