"""Where microvm-check keeps things on the host.

One root (default /var/lib/microvm-check, overridable with MICROVM_CHECK_STATE) so that a sweep
after a crash knows exactly what could be ours, and tests can use a private root.
It lives in runner.vm, the lowest layer that needs it (the engine's VM directory, the template
store, the doctor); the service, vmimages and the benchmarks import it from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path("/var/lib/microvm-check")


@dataclass(frozen=True)
class StateDir:
    root: Path

    @classmethod
    def default(cls) -> StateDir:
        return cls(Path(os.environ.get("MICROVM_CHECK_STATE", DEFAULT_ROOT)))

    @property
    def cache(self) -> Path:
        """Downloads and intermediate build products, reusable across template rebuilds."""
        return self.root / "cache"

    @property
    def templates(self) -> Path:
        return self.root / "templates"

    @property
    def vms(self) -> Path:
        """One directory per live VM (overlay, sockets, pid); anything here at start-up is an orphan."""
        return self.root / "vms"

    def ensure(self) -> StateDir:
        for path in (self.root, self.cache, self.templates, self.vms):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self
