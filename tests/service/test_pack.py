"""Packing a local checkout: no .git, no links out of the tree, streamed."""

from __future__ import annotations

import io
import os
import socket
import tarfile
from pathlib import Path

import pytest

from runner.service.pack import PackError, scan, stream


def tree(root: Path) -> None:
    (root / "src").mkdir()
    (root / "src" / "main.py").write_text("print('hi')\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    os.symlink("src/main.py", root / "link-inside")


def test_pack_skips_git_and_keeps_inside_links(tmp_path: Path) -> None:
    tree(tmp_path)
    paths = scan(tmp_path)
    assert [str(p) for p in paths] == ["src", "link-inside", "run.sh", "src/main.py"]
    data = b"".join(stream(tmp_path, paths))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getmember("link-inside").issym()
        assert tar.getmember("link-inside").linkname == "src/main.py"
        assert tar.getmember("run.sh").mode & 0o111
        assert tar.getmember("src/main.py").uid == 0
        assert tar.extractfile("src/main.py").read() == b"print('hi')\n"


@pytest.mark.parametrize("target", ["../../outside", "/etc/passwd", "../src/../../../x", "../../co-sibling/x"])
def test_links_out_of_the_tree_are_refused(tmp_path: Path, target: str) -> None:
    root = tmp_path / "co"
    root.mkdir()
    (root / "src").mkdir()
    os.symlink(target, root / "src" / "escape")
    with pytest.raises(PackError, match="escape"):
        scan(root)


def test_special_files_are_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(PackError, match="pipe: not a regular file"):
        scan(tmp_path)


def test_sockets_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(PackError, match="not a regular file"):
            scan(tmp_path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(PackError, match="not a directory"):
        scan(tmp_path / "missing")


def test_large_file_streams_in_chunks(tmp_path: Path) -> None:
    (tmp_path / "big").write_bytes(os.urandom(3 * 1024 * 1024 + 5))
    chunks = list(stream(tmp_path, scan(tmp_path)))
    assert len(chunks) > 3 and max(len(c) for c in chunks) <= 1024 * 1024


def test_link_to_a_sibling_inside_is_fine(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "data").write_text("x")
    os.symlink("../data", tmp_path / "src" / "data")
    assert "src/data" in [str(p) for p in scan(tmp_path)]
