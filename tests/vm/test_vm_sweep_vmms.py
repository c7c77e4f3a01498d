"""The start-up sweep kills VMMs only (ATTACK.md finding 4): a QEMU of a VM uid naming a path under the VM
directory; any other process naming such a path (an operator's `tail -f`) survives and is not counted."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from runner.uidrange import VM_UIDS
from runner.vm.sweep import processes_under, sweep
from tests.conftest import require


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def test_a_process_naming_a_vm_path_that_is_no_vmm_survives_the_sweep(need_root: None, tmp_path: Path) -> None:
    vms = tmp_path / "vms"
    (vms / "vm-orphan").mkdir(parents=True)
    log = vms / "vm-orphan" / "serial.log"
    log.write_text("")
    # as root (the operator) and as a VM uid: neither is a QEMU
    tails = [subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(60)", str(log)], user=user)
             for user in (0, VM_UIDS[-1])]
    try:
        assert not set(processes_under(vms)) & {t.pid for t in tails}
        sweep(vms)
        assert all(_alive(t) for t in tails), "the sweep killed a process that is no VMM"
    finally:
        for t in tails:
            t.kill()
            t.wait()


def test_a_qemu_of_a_vm_uid_under_the_vm_directory_is_swept(need_root: None, tmp_path: Path) -> None:
    binary = shutil.which("qemu-system-x86_64")
    require(binary is not None, "QEMU is not installed")
    vms = tmp_path / "vms"
    (vms / "vm-orphan").mkdir(parents=True)
    qemu = subprocess.Popen([str(binary), "-machine", "none", "-display", "none", "-nodefaults", "-S",
                             "-name", f"guest={vms / 'vm-orphan'}"], user=VM_UIDS[-1], group=65534,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while qemu.pid not in processes_under(vms):  # until it has exec'd QEMU
            assert _alive(qemu) and time.monotonic() < deadline, "QEMU did not start"
            time.sleep(0.02)
        assert f"process {qemu.pid}" in sweep(vms)
        assert qemu.wait(timeout=30) == -9
    finally:
        if _alive(qemu):
            qemu.kill()
            qemu.wait()

