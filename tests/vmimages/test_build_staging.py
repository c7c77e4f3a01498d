"""Review: the template build's staging directory, where an image's tree (set-id files of any owner) is
unpacked, is root's and 0700 whatever was there before and whatever the umask, and a failed build removes it.
Pins vmimages.build._staging (the real-VM refusal tests cover it end to end, tests/vm/test_vm_image_refusals.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from runner.errors import ImageError
from vmimages.build import _staging


def test_the_staging_directory_is_private_even_over_an_open_one_and_with_a_loose_umask(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "staging" / "node20"
    path.mkdir(parents=True, mode=0o777)
    (path / "left-over").write_text("x")
    old = os.umask(0)
    try:
        with _staging(path) as staging:
            info = staging.lstat()
            assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
            assert list(staging.iterdir()) == []
    finally:
        os.umask(old)


def test_a_refused_build_leaves_no_staging_tree(tmp_path: Path) -> None:
    path = tmp_path / "staging" / "node20"
    with pytest.raises(ImageError), _staging(path) as staging:
        (staging / "rootfs" / "image").mkdir(parents=True)
        (staging / "rootfs" / "image" / "setuid").write_text("x")
        raise ImageError("refused")
    assert not path.exists()
