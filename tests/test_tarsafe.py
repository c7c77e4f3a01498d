"""The host's rules for tar streams a guest produced (runner.tarsafe)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from runner import tarsafe


def member(name: str, data: bytes | None = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    if data is not None and kind == tarfile.REGTYPE:
        info.size = len(data)
    return info, data


def tar_of(*members: tuple) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("raw,why", [
    ("/etc/passwd", "absolute"), ("a/../../x", "'..'"), ("..", "'..'"), ("a\\b", "backslash"),
    ("a\x00b", "control"), ("\x1b[2J", "control"), ("x" * 2000, "longer than"), ("/".join("d" * 40), "deeper"),
    ("a/" + "n" * 300, "longer than 255"),
])
def test_unsafe_names(raw: str, why: str) -> None:
    with pytest.raises(tarsafe.UnsafeTar, match=why.replace("[", r"\[")):
        tarsafe.safe_name(raw)


def test_safe_names_are_normalised() -> None:
    assert tarsafe.safe_name("./a//b/./c") == "a/b/c"
    assert tarsafe.safe_name("./") == ""


def test_links_devices_and_bad_names_are_skipped_not_written(tmp_path: Path) -> None:
    stream = tar_of(
        member("ok/file.txt", b"fine"),
        member("ok/link", None, tarfile.SYMTYPE, "/etc/shadow"),
        member("hard", None, tarfile.LNKTYPE, "/etc/shadow"),
        member("dev", None, tarfile.CHRTYPE),
        member("../escape", b"x"),
    )
    result = tarsafe.extract(stream, tmp_path)
    assert result.files == [("ok/file.txt", 4)]
    assert {name for name, _ in result.skipped} == {"ok/link", "hard", "dev", "../escape"}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["file.txt", "ok"]


def test_a_symlink_already_in_the_destination_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / "sub")
    result = tarsafe.extract(tar_of(member("sub/planted", b"evil")), dest)
    assert result.files == [] and not (outside / "planted").exists()
    assert result.skipped[0][0] == "sub/planted"


def test_bombs_stop_early(tmp_path: Path) -> None:
    with pytest.raises(tarsafe.UnsafeTar, match="more than 3 entries"):
        tarsafe.extract(tar_of(*[member(f"f{i}") for i in range(10)]), tmp_path, tarsafe.Limits(max_files=3))
    sizes = tmp_path / "sizes"
    sizes.mkdir()
    with pytest.raises(tarsafe.UnsafeTar, match="in total"):
        tarsafe.extract(tar_of(member("a", b"x" * 600), member("b", b"x" * 600)), sizes, tarsafe.Limits(max_total_bytes=1000))
    assert [p.name for p in sizes.iterdir()] == ["a"], "what came before the bound stays"


def test_exec_bit_is_kept_and_nothing_else(tmp_path: Path) -> None:
    info, data = member("run.sh", b"#!/bin/sh\n")
    info.mode = 0o4777
    tarsafe.extract(tar_of((info, data)), tmp_path)
    assert (tmp_path / "run.sh").stat().st_mode & 0o7777 == 0o755


def test_garbage_is_not_a_tar(tmp_path: Path) -> None:
    with pytest.raises(tarsafe.UnsafeTar, match="not a valid tar"):
        tarsafe.extract(io.BytesIO(b"garbage" * 300), tmp_path)
