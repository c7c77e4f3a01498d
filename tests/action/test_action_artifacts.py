"""Artifact extraction from the service's tar stream: escapes, links, bombs, workspace traps."""

from __future__ import annotations

import errno
import io
import os
import re
import tarfile
from pathlib import Path

import pytest

from action.artifacts import ArtifactError, ArtifactLimits, BoundedWriter, deliver, extract, glob_regex, matches


def tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def file(name: str, data: bytes = b"data") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws


def test_matching_files_and_dirs_are_extracted(workspace: Path) -> None:
    stream = tar(special("dist", tarfile.DIRTYPE), file("dist/a.whl", b"wheel"), file("report.xml", b"<x/>"),
                 file("secret.txt"))
    result = extract(stream, workspace, ["report.xml", "dist/*.whl"])
    assert sorted((f.path, f.size) for f in result.files) == [("dist/a.whl", 5), ("report.xml", 4)]
    assert (workspace / "dist" / "a.whl").read_bytes() == b"wheel"
    assert not (workspace / "secret.txt").exists()
    assert ("secret.txt", "does not match any requested artifact glob") in result.skipped


@pytest.mark.parametrize("name", ["../escape", "/etc/evil", "a/../../escape", "a\\..\\escape"])
def test_escaping_names_are_refused(workspace: Path, name: str) -> None:
    result = extract(tar(file(name)), workspace, ["**"])
    assert result.files == [] and result.skipped[0][0] == name
    assert not (workspace.parent / "escape").exists()


@pytest.mark.parametrize("kind,linkname", [(tarfile.SYMTYPE, "/etc/passwd"), (tarfile.LNKTYPE, "/etc/passwd"),
                                           (tarfile.CHRTYPE, ""), (tarfile.FIFOTYPE, "")])
def test_links_and_devices_are_never_extracted(workspace: Path, kind: bytes, linkname: str) -> None:
    result = extract(tar(special("out", kind, linkname)), workspace, ["out"])
    assert result.files == [] and not os.path.lexists(workspace / "out")
    assert result.skipped[0][0] == "out"
    assert re.search("link|device|fifo", result.skipped[0][1])


def test_symlink_already_in_the_workspace_is_not_followed(workspace: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (workspace / "out").symlink_to(outside)
    (workspace / "report.xml").symlink_to(outside / "target")
    result = extract(tar(file("out/planted"), file("report.xml")), workspace, ["out/*", "report.xml"])
    assert result.files == []
    assert list(outside.iterdir()) == []
    assert len(result.skipped) == 2


def test_hard_link_in_the_destination_is_never_written_through(workspace: Path, tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.write_bytes(b"keep")
    os.link(outside, workspace / "report.xml")
    result = extract(tar(file("report.xml", b"new")), workspace, ["report.xml"])
    assert outside.read_bytes() == b"keep"
    assert result.skipped == [("report.xml", "already exists in the destination (never overwritten)")]


def test_count_bomb_stops_with_an_error_and_keeps_what_was_extracted(workspace: Path) -> None:
    stream = tar(*[file(f"f{i}") for i in range(20)])
    with pytest.raises(ArtifactError, match="more than 5"):
        extract(stream, workspace, ["*"], ArtifactLimits(max_files=5))
    assert len(list(workspace.iterdir())) == 5


def test_a_file_over_the_total_is_skipped(workspace: Path) -> None:
    stream = tar(file("a", b"x" * 600), file("b", b"x" * 600))
    result = extract(stream, workspace, ["*"], ArtifactLimits(max_total_bytes=1000))
    assert result.skipped == [("b", "would take the files over 1000 bytes in total")]
    assert (workspace / "a").exists() and not (workspace / "b").exists()


def test_oversized_single_file_is_refused(workspace: Path) -> None:
    result = extract(tar(file("big", b"x" * 100), file("small")), workspace, ["*"],
                     ArtifactLimits(max_file_bytes=50))
    assert [(f.path, f.size) for f in result.files] == [("small", 4)] and result.skipped[0][0] == "big"


def test_truncated_stream_is_an_error_and_leaves_no_partial_file(workspace: Path) -> None:
    data = tar(file("a", b"x" * 5000)).getvalue()[:2048]
    with pytest.raises(ArtifactError, match=r"^artifacts: the stream ended inside the data of a member \(\d+ bytes missing\)$"):
        extract(io.BytesIO(data), workspace, ["*"])
    assert list(workspace.iterdir()) == []


def test_not_a_tar_is_an_error(workspace: Path) -> None:
    with pytest.raises(ArtifactError, match="corrupt tar header at byte 0"):
        extract(io.BytesIO(b"garbage" * 200), workspace, ["*"])


def test_bounded_writer_stops_a_download() -> None:
    writer = BoundedWriter(io.BytesIO(), 10)
    writer.write(b"x" * 10)
    with pytest.raises(ArtifactError, match="^artifact stream exceeds 10 bytes$"):
        writer.write(b"y")


@pytest.mark.parametrize("pattern,name,expected", [
    ("*.xml", "report.xml", True), ("*.xml", "sub/report.xml", False), ("**/*.xml", "sub/deep/r.xml", True),
    ("**/*.xml", "r.xml", True), ("dist/*.whl", "dist/a.whl", True), ("htmlcov", "htmlcov/index.html", True),
    ("r?.txt", "r1.txt", True), ("[ab].txt", "c.txt", False), ("[!ab].txt", "c.txt", True),
])
def test_globs(pattern: str, name: str, expected: bool) -> None:
    assert matches(name, [glob_regex(pattern)]) is expected


def test_overlapping_globs_take_each_file_once(workspace: Path) -> None:
    stream = tar(file("out/a.txt", b"a"), file("out/sub/r.xml", b"<r/>"), file("report.xml", b"<x/>"))
    result = extract(stream, workspace, ["out/**", "out/**/*.xml", "report.xml"])
    assert [(f.path, f.size) for f in result.files] == [("out/a.txt", 1), ("out/sub/r.xml", 4), ("report.xml", 4)]
    assert result.skipped == []


def test_deliver_moves_a_fresh_directory_into_the_workspace(workspace: Path, tmp_path: Path) -> None:
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    (workspace / "out").mkdir()
    (workspace / "out" / "a.txt").write_text("the checkout's own file")
    result = deliver(tar(file("out/a.txt", b"guest"), special("out/l", tarfile.SYMTYPE, "/etc")), workspace,
                     "build/artifacts", ["out/**"], temp)
    assert [(f.path, f.size) for f in result.files] == [("out/a.txt", 5)] and result.skipped[0][0] == "out/l"
    assert (workspace / "out" / "a.txt").read_text() == "the checkout's own file"
    assert (workspace / "build" / "artifacts" / "out" / "a.txt").read_bytes() == b"guest"
    assert list(temp.iterdir()) == []


def test_deliver_across_file_systems_copies_with_its_own_writes(workspace: Path, tmp_path: Path, monkeypatch) -> None:
    import action.artifacts as artifacts

    def no_rename(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(artifacts.os, "rename", no_rename)
    result = deliver(tar(file("out/sub/a.txt", b"guest"), file("run.sh", b"#!/bin/sh")), workspace, "artifacts",
                     ["**"], tmp_path)
    assert len(result.files) == 2
    assert (workspace / "artifacts" / "out" / "sub" / "a.txt").read_bytes() == b"guest"


@pytest.mark.parametrize("target", [".git", "x/.GIT/y", "../up", "/abs"])
def test_deliver_refuses_a_target_in_git_or_outside(workspace: Path, tmp_path: Path, target: str) -> None:
    with pytest.raises(ArtifactError, match="artifacts-path"):
        deliver(tar(file("a")), workspace, target, ["*"], tmp_path)


@pytest.mark.parametrize("pattern,name,expected", [
    ("[^b]x", "ax", False), ("[^b]x", "^x", True), ("[^b]x", "bx", True),  # `^` is a literal, as in glob()
    ("[[]x", "[x", True), ("[!]]x", "ax", True),
])
def test_globs_match_like_the_guests_glob(pattern: str, name: str, expected: bool) -> None:
    """The guest picks files with Python's glob (fnmatch classes); the host must not drop what it sent."""
    import fnmatch

    assert fnmatch.fnmatchcase(name, pattern) is expected
    assert matches(name, [glob_regex(pattern)]) is expected


def test_a_glob_with_an_empty_range_matches_nothing_instead_of_crashing(workspace: Path) -> None:
    """`[z-a]` is a glob that matches nothing for the guest; as a regex it raised re.error after the job
    had run (an internal error with a traceback instead of the artifacts of the other globs)."""
    result = extract(tar(file("out/a.txt", b"a"), file("b.txt", b"b")), workspace, ["out/[z-a]", "b.txt"])
    assert [(f.path, f.size) for f in result.files] == [("b.txt", 1)]
