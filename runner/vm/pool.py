"""VMs restored ahead of time, waiting for a job to claim them.

Starting QEMU costs 45-70 ms of every restore (docs/platform.md) and, under TCG, the first answer of a
restored guest another 100-300 ms of code translation. Neither depends on the job, so the pool
pays both in the background: it keeps a few restored, never-used VMs per template variant and
tops them up after each take. A job still gets a VM no one has used; its identity (clock,
entropy, hostname) and egress policy are applied when it claims it.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from runner.vm.hypervisor import Snapshot
from runner.vm.vm import VM

log = logging.getLogger(__name__)


class SpareVMs:
    """Restored VMs bound to no job yet, per template variant, refilled after each take (the service's
    `PrewarmedVMs` are another thing: VMs restored for one queued GitHub job, with its policy)."""

    def __init__(self, prepare: Callable[[Snapshot], VM], size: int) -> None:
        self._prepare = prepare
        self.size = size
        self._ready: dict[Snapshot, list[VM]] = defaultdict(list)
        self._filling: dict[Snapshot, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closed = False

    def take(self, snapshot: Snapshot) -> VM | None:
        while True:
            with self._lock:
                entries = self._ready[snapshot]
                if not entries:
                    return None
                vm = entries.pop(0)
            if not vm.destroyed and vm.machine.alive():
                return vm
            vm.destroy()

    def refill(self, snapshot: Snapshot) -> None:
        """Top up the pool for `snapshot` in the background (one filler per snapshot).

        VMs ready for an older build of the same template and variant are ended: after a rebuild
        (a new digest) no one asks for them again.
        """
        self._evict_older_builds(snapshot)
        if self.size <= 0:
            return
        with self._lock:
            if self._closed or snapshot in self._filling or len(self._ready[snapshot]) >= self.size:
                return
            filler = threading.Thread(target=self._fill, args=(snapshot,), name="pool-fill", daemon=True)
            self._filling[snapshot] = filler
        filler.start()

    def _evict_older_builds(self, snapshot: Snapshot) -> None:
        lineage = _lineage(snapshot)
        with self._lock:
            stale = [s for s in self._ready if s != snapshot and _lineage(s) == lineage]
            evicted = [vm for s in stale for vm in self._ready.pop(s)]
        for vm in evicted:
            vm.destroy()

    def _fill(self, snapshot: Snapshot) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed or len(self._ready[snapshot]) >= self.size:
                        return
                vm = self._prepare(snapshot)
                with self._lock:
                    if self._closed:
                        vm.destroy()
                        return
                    self._ready[snapshot].append(vm)
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
        for vm in entries:
            vm.destroy()


def _lineage(snapshot: Snapshot) -> tuple[Path, str]:
    """(template directory, variant) of a snapshot, whatever its digest.

    Its files are <templates>/<name>/<digest>/<variant>/state.bin (runner.vm.templates)."""
    variant_dir = snapshot.state_file.parent
    return variant_dir.parent.parent, variant_dir.name
