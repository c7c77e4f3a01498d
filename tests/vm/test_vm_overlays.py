"""A VM's disk overlay is a copy of one empty qcow2 made per template disk (runner.vm.qemu.EmptyOverlays):
each copy is a valid overlay of that disk, private to root, and a removed (rebuilt) disk's image is dropped."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from runner.vm.qemu import EmptyOverlays
from tests.conftest import require


@pytest.fixture
def qemu_img() -> str:
    path = shutil.which("qemu-img")
    require(path is not None, "qemu-img is not installed")
    assert path is not None
    return path


def info(qemu_img: str, image: Path) -> dict[str, object]:
    out = subprocess.run([qemu_img, "info", "-U", "--output=json", str(image)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


def test_each_vm_gets_a_valid_private_overlay_of_its_disk(tmp_path: Path, qemu_img: str) -> None:
    base = tmp_path / "disk.img"
    with open(base, "wb") as f:
        f.truncate(64 << 20)
    overlays = EmptyOverlays()
    first, second = tmp_path / "a.qcow2", tmp_path / "b.qcow2"
    overlays.write(base, first)
    overlays.write(base, second)
    assert first.read_bytes() == second.read_bytes()
    for image in (first, second):
        meta = info(qemu_img, image)
        assert meta["format"] == "qcow2" and meta["virtual-size"] == 64 << 20
        assert meta["backing-filename"] == str(base)
        assert image.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):  # never written over an existing file
        overlays.write(base, second)


def test_a_rebuilt_disk_gets_a_new_image(tmp_path: Path, qemu_img: str) -> None:
    overlays = EmptyOverlays()
    old, new = tmp_path / "old.img", tmp_path / "new.img"
    for disk, size in ((old, 32 << 20), (new, 48 << 20)):
        with open(disk, "wb") as f:
            f.truncate(size)
    overlays.write(old, tmp_path / "1.qcow2")
    old.unlink()
    overlays.write(new, tmp_path / "2.qcow2")
    assert info(qemu_img, tmp_path / "2.qcow2")["virtual-size"] == 48 << 20
    assert list(overlays._images) == [new]
