"""Start-up sweep: whatever a crashed predecessor left under the VM directory is killed and removed.

Processes are found by what they are, not by what a pid file says: any process whose command
line names a path under our VM directory is one of our VMMs (a pid file could be stale and
point at an unrelated process that reused the pid).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from runner.vm import cgroup, checkoutdisk


def processes_under(vms_dir: Path) -> list[int]:
    marker = (str(vms_dir).rstrip("/") + "/").encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry))
    return found


def sweep(vms_dir: Path, keep: frozenset[str] = frozenset()) -> list[str]:
    """Kill orphaned VMMs, remove their cgroups and delete VM directories (except names in `keep`);
    say what was found."""
    found = cgroup.sweep(cgroup.scope_for(vms_dir))
    found += cgroup.remove_empty_scopes()  # other engines' that crashed: their VM cgroups were swept by them
    for pid in processes_under(vms_dir):
        try:
            os.kill(pid, signal.SIGKILL)
            found.append(f"process {pid}")
        except ProcessLookupError:
            pass
    if vms_dir.exists():
        for entry in vms_dir.iterdir():
            if entry.name in keep:
                continue
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            found.append(f"{entry.name}")
            found += checkoutdisk.remove_staging(entry.name)
    return found
