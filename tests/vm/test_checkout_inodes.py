"""Unpacking a checkout counts every inode it makes, directories its paths only imply too (issue 17).

Host side only (no VM): `checkoutdisk.unpack` into a temporary directory, and `make_image` (mkfs.ext4)
from it. Before, `a/b/.../f` made its missing parents without counting them: about 0.24 directories
per tar byte, so 12 MiB of tar could exhaust /dev/shm's inodes, and mkfs was given too few (`-N`).
"""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path

import pytest

from runner import tarsafe
from runner.vm import checkoutdisk


def tar_of(names: list[str], dirs: list[str] = ()) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in dirs:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    buf.seek(0)
    return buf


def deep(n: int, depth: int) -> str:
    return "/".join([f"d{n}", *["a"] * depth, "f"])


def test_an_inode_bomb_is_refused_before_it_fills_the_tmpfs(tmp_path: Path) -> None:
    bomb = tar_of([deep(n, 200) for n in range(300)])  # ~60,000 implied directories in ~1 MiB of tar
    size = len(bomb.getvalue())
    with pytest.raises(tarsafe.UnsafeTar, match="more than .* files, links and directories"):
        checkoutdisk.unpack(bomb, tmp_path / "tree")
    made = sum(1 for _ in (tmp_path / "tree").rglob("*"))
    assert made <= checkoutdisk.inode_budget(size)  # stopped at the budget, not after the damage
    print(f"inode bomb of {size} bytes: refused after {made} inodes (budget {checkoutdisk.inode_budget(size)})")


def test_a_normal_checkout_unpacks_and_its_implied_directories_are_counted(tmp_path: Path) -> None:
    names = [f"src/pkg{n}/module{m}.py" for n in range(20) for m in range(10)]  # no directory members
    unpacked = checkoutdisk.unpack(tar_of(names), tmp_path / "tree")
    assert unpacked.files == 200 and unpacked.dirs == 1 + 1 + 20  # the root, src, src/pkgN
    listed = checkoutdisk.unpack(tar_of(names, dirs=["src", "src/pkg0"]), tmp_path / "again")
    assert listed.dirs == unpacked.dirs  # a listed directory that was implied before is not counted twice


def test_mkfs_gets_the_real_inode_count(tmp_path: Path) -> None:
    """One file 251 directories deep: mkfs -d needs 253 inodes, where the old count gave it 66."""
    staging = tmp_path / "staging"
    staging.mkdir()
    unpacked = checkoutdisk.unpack(tar_of([deep(0, 250)]), staging / checkoutdisk.TREE, max_inodes=1000)
    assert unpacked.inodes() == 1 + 251 + 1  # the root, d0 and 250 below it, the file
    checkoutdisk.make_image(staging, tmp_path / "disk.img", unpacked, str(uuid.uuid4()))
    assert (tmp_path / "disk.img").stat().st_size > 0
