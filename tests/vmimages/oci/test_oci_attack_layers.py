"""Review attacks on the layer applier: members that crashed it with a traceback instead of a one-line
ImageError, and bounds a small layer could step around (directories made for a member's parents, the
memory held per member). As root (owners)."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from runner.errors import ImageError
from tests.conftest import require
from tests.vmimages.oci.images import Dir, File, Hardlink, write_layout
from vmimages.oci import ImageLimits, apply_layers, verify_layout

SMALL = ImageLimits(max_files=100, max_uncompressed_bytes=8 * 1024**2, max_file_bytes=4 * 1024**2)


@pytest.fixture(autouse=True)
def _root() -> None:
    require(os.geteuid() == 0, "not running as root (the applier keeps the image's owners)")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "private").mkdir(mode=0o700)
    (tmp_path / "private" / "root").mkdir()
    return tmp_path / "private" / "root"


def raw_tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", linkname: str = "",
           **pax: str) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.pax_headers = kind, linkname, dict(pax)
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


def apply(tmp_path: Path, root: Path, *layers, limits: ImageLimits = SMALL) -> None:
    layout = write_layout(tmp_path / "img", list(layers))
    apply_layers(verify_layout(layout.path).layers, root, limits)


@pytest.mark.parametrize("layer, says", [
    (raw_tar(member("f", data=b"x", uid="99999999999")), "owner"),
    (raw_tar(member("f", data=b"x", uid="-5")), "owner"),
    (raw_tar(member("d", tarfile.DIRTYPE, gid="4294967296")), "owner"),
    (raw_tar(member("s", tarfile.SYMTYPE, linkname="x", gid="99999999999")), "owner"),
    (raw_tar(member(".", tarfile.DIRTYPE, uid="99999999999")), "owner"),
    ([Hardlink("b", "nodir/x")], "not a regular file in the image"),
    ([Dir("d"), File("d/f", "x"), Hardlink("d", "d/f")], "inside what it replaces"),
])
def test_members_that_crashed_the_applier_are_refused_in_one_line(tmp_path, root, layer, says) -> None:
    """Attack: a pax uid or gid past uid_t (OverflowError from chown), a hardlink under a missing directory or
    into the directory it replaces (FileNotFoundError): a traceback, not the ImageError the CLI shows."""
    with pytest.raises(ImageError, match=says):
        apply(tmp_path, root, layer)


@pytest.mark.parametrize("mtime", ["inf", "1e400", "-inf"])
def test_an_infinite_pax_mtime_is_ignored_not_a_crash(tmp_path, root, mtime) -> None:
    """Attack: pax mtime=inf reached int() (OverflowError); it is left unset, as a NaN one already was."""
    apply(tmp_path, root, raw_tar(member("f", data=b"x", mtime=mtime)))
    assert (root / "f").read_bytes() == b"x"


def test_an_operating_system_refusal_is_an_image_error_naming_the_member(tmp_path, root) -> None:
    """Whatever the host's file system refuses (a link count past ext4's 65000, no space left) ends the apply
    with an ImageError naming the member, not a traceback."""
    (root / "ro").mkdir()  # made immutable: stands in for EMLINK, ENOSPC and the like
    if subprocess.run(["chattr", "+i", str(root / "ro")], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not supported here")
    try:
        with pytest.raises(ImageError, match=r"member 'ro/f'.*Operation not permitted"):
            apply(tmp_path, root, [File("ro/f", "x")])
    finally:
        subprocess.run(["chattr", "-i", str(root / "ro")], check=True)


def test_directories_made_for_a_members_parents_count_against_the_file_bound(tmp_path, root) -> None:
    """Attack: one member 120 directories deep made 119 directories and counted once: 500_000 such members
    (a few MB of gzip) would make 60 million directories on the host. Each directory made counts now."""
    deep = "/".join(f"d{n}" for n in range(120))
    with pytest.raises(ImageError, match="more than 100 members"):
        apply(tmp_path, root, [File(f"{deep}/f", "x")])


def test_memory_does_not_grow_with_every_member_s_long_name(tmp_path, root) -> None:
    """Attack: tarfile's stream mode keeps every TarInfo it read (with a 4 KiB name, twice with its pax copy)
    and the layer's own-entries set kept every full name: about 9 KiB per member, so 4 GiB for the 500_000
    members allowed. Both are dropped or hashed now: memory stays flat in the member count."""
    deep = "/".join(["d" * 30] * 110)
    layer = [File(f"{deep}/{'x' * 200}{n}", "") for n in range(1000)]
    limits = ImageLimits(max_files=10_000)
    layout = write_layout(tmp_path / "img", [layer])
    layers = verify_layout(layout.path).layers
    tracemalloc.start()
    try:
        apply_layers(layers, root, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * 1024**2, f"{peak} bytes at the peak for 1000 members (9 MB before)"
