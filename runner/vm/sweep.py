"""Start-up sweep: whatever a crashed predecessor left under the VM directory is killed and removed.

Processes are found by what they are, not by what a pid file says (a pid file could be stale and
point at an unrelated process that reused the pid): a VMM is a QEMU (its executable a
`qemu-system-*`) running as one of the VMs' uids (runner.uidrange VM_UIDS, leased by the jail) whose
command line names a path under our VM directory. An operator's `tail -f .../serial.log`, or any
other user's process that names such a path, is neither killed nor counted.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from runner.uidrange import VM_UIDS
from runner.vm import cgroup, checkoutdisk


def processes_under(vms_dir: Path) -> list[int]:
    """The VMMs of VMs under `vms_dir`: QEMUs of the VMs' uids naming a path under it."""
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
        if marker in cmdline and _is_vmm(entry):
            found.append(int(entry))
    return found


def _is_vmm(pid: str) -> bool:
    """A QEMU system emulator whose every uid (real, effective, saved, fs) is one of the VMs'."""
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
        with open(f"/proc/{pid}/status", "rb") as f:
            uids = next((line.split()[1:] for line in f if line.startswith(b"Uid:")), [])
    except (OSError, StopIteration):
        return False
    return exe.startswith("qemu-system-") and bool(uids) and all(int(uid) in VM_UIDS for uid in uids)


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
