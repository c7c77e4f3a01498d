"""Artifact tars from the guest: hostile members reject the whole archive, clean ones are re-written."""

from __future__ import annotations

import io
import tarfile
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from service_fakes import member, tar_of

from runner.service.config import ArtifactLimits
from runner.service.safetar import ArchiveError, check_tar, copy_validated
from runner.tarsafe import safe_name as clean_name

LIMITS = ArtifactLimits(max_count=10, max_total_bytes=1000)


def validate(data: bytes, limits: ArtifactLimits = LIMITS) -> tuple[list, bytes]:
    out = io.BytesIO()
    files = copy_validated(io.BytesIO(data), out, limits)
    return files, out.getvalue()


def test_clean_tar_is_rewritten_with_neutral_metadata() -> None:
    info = member("dist/app.whl")
    info.uid, info.uname, info.mode = 4242, "mallory", 0o4777
    data = tar_of([(member("./dist", tarfile.DIRTYPE), None), (info, b"wheel"), (member("report.xml"), b"<ok/>")])
    files, out = validate(data)
    assert [(f.path, f.size) for f in files] == [("dist/app.whl", 5), ("report.xml", 5)]
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["dist", "dist/app.whl", "report.xml"]
        whl = tar.getmember("dist/app.whl")
        assert (whl.uid, whl.uname, whl.mode) == (0, "", 0o755)
        assert tar.extractfile(whl).read() == b"wheel"


@pytest.mark.parametrize("info, data, why", [
    (member("/etc/passwd"), b"x", "absolute path"),
    (member("a/../../etc/passwd"), b"x", "'..'"),
    (member(".."), b"x", "'..'"),
    (member("link", tarfile.SYMTYPE, "/etc/shadow"), None, "links are not allowed"),
    (member("link", tarfile.SYMTYPE, "../../outside"), None, "links are not allowed"),
    (member("hard", tarfile.LNKTYPE, "/etc/shadow"), None, "links are not allowed"),
    (member("dev", tarfile.CHRTYPE), None, "device"),
    (member("blk", tarfile.BLKTYPE), None, "device"),
    (member("fifo", tarfile.FIFOTYPE), None, "fifo"),
    (member("evil\x1b[2Jname"), b"x", "control characters"),
    (member("back\\slash"), b"x", "backslash"),
    (member("x" * 2000), b"x", "longer than"),
])
def test_hostile_members_are_refused(info: tarfile.TarInfo, data: bytes | None, why: str) -> None:
    with pytest.raises(ArchiveError, match=why.replace("[", r"\[").replace("(", r"\(")):
        validate(tar_of([(member("ok.txt"), b"fine"), (info, data)]))


def test_huge_member_is_refused_before_its_data_is_copied() -> None:
    with pytest.raises(ArchiveError, match="larger than 1000 bytes in total"):
        validate(tar_of([(member("big.bin"), b"\0" * 1001)]))


def test_total_size_counts_all_members() -> None:
    with pytest.raises(ArchiveError, match="in total"):
        validate(tar_of([(member(f"f{i}"), b"\0" * 400) for i in range(3)]))


def test_too_many_members() -> None:
    with pytest.raises(ArchiveError, match="more than 10 members"):
        validate(tar_of([(member(f"f{i}"), b"") for i in range(11)]))


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ArchiveError, match="appears twice"):
        validate(tar_of([(member("a"), b"1"), (member("./a"), b"2")]))


def test_member_below_a_file_is_refused() -> None:
    with pytest.raises(ArchiveError, match="its parent is a file"):
        validate(tar_of([(member("a"), b"1"), (member("a/b"), b"2")]))


def test_truncated_and_garbage_streams() -> None:
    data = tar_of([(member("a"), b"y" * 900)])
    with pytest.raises(ArchiveError):
        validate(data[:700])
    with pytest.raises(ArchiveError, match="tar"):
        validate(b"this is not a tar at all" * 40)


def test_empty_stream_gives_no_files() -> None:
    assert validate(tar_of([]))[0] == []


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_clean_name_never_escapes(raw: str) -> None:
    try:
        name = clean_name(raw)
    except ArchiveError:
        return
    assert not name.startswith("/")
    assert ".." not in name.split("/")
    assert all(ord(c) >= 32 for c in name)


def test_check_tar_counts_and_rejects_garbage() -> None:
    assert check_tar(io.BytesIO(tar_of([(member("a"), b"1"), (member("b"), b"2")]))) == 2
    with pytest.raises(ArchiveError, match="not a valid tar"):
        check_tar(io.BytesIO(b"\x01" * 2048))


def test_check_tar_memory_stays_flat_however_many_headers() -> None:
    """A checkout within the byte limit can hold millions of empty files: only count their headers."""
    count = 20_000
    data = tar_of([(member(f"f{i}"), b"") for i in range(count)])
    tracemalloc.start()
    try:
        assert check_tar(io.BytesIO(data)) == count
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 * 1024 * 1024  # keeping every TarInfo would take about 8 MiB here
