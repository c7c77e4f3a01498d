"""The start-up sweep also removes an orphaned VM's checkout staging on tmpfs (a service killed mid-unpack)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from runner.vm import checkoutdisk
from runner.vm.sweep import sweep


def test_an_orphans_staging_is_swept_and_other_staging_is_kept(tmp_path: Path) -> None:
    vms = tmp_path / "vms"
    (vms / "vm-orphan").mkdir(parents=True)
    orphan = Path(tempfile.mkdtemp(prefix=checkoutdisk.staging_prefix("vm-orphan"), dir=checkoutdisk.STAGING_DIR))
    (orphan / "c").mkdir()
    (orphan / "c" / "conftest.py").write_text("half unpacked")
    other = Path(tempfile.mkdtemp(prefix=checkoutdisk.staging_prefix("vm-alive"), dir=checkoutdisk.STAGING_DIR))
    try:
        found = sweep(vms)
        assert "vm-orphan" in found and str(orphan) in found
        assert not orphan.exists()
        assert other.exists(), "a VM that is not swept keeps its staging"
    finally:
        for path in (orphan, other):
            if path.exists():
                shutil.rmtree(path)
