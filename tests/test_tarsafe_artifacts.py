"""Artifact tars from the guest: hostile members are skipped and named, clean ones are re-written."""

from __future__ import annotations

import io
import tarfile
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runner.tarsafe import NOTES_DIR, SKIPPED_KEY, SKIPPED_NAME_KEY, Limits, check_tar, copy_validated, extract
from runner.tarsafe import UnsafeTar as ArchiveError
from runner.tarsafe import safe_name as clean_name
from tests.service.service_fakes import member, tar_of

LIMITS = Limits(max_files=10, max_file_bytes=1000, max_total_bytes=1000)


def validate(data: bytes, limits: Limits = LIMITS, stop_names: list[str] = ()) -> tuple[list, bytes]:
    out = io.BytesIO()
    copied = copy_validated(io.BytesIO(data), out, limits, stop_names=stop_names)
    if copied.stopped:
        raise ArchiveError(copied.stopped)
    return copied.files, out.getvalue()


def copied(data: bytes, limits: Limits = LIMITS):
    out = io.BytesIO()
    result = copy_validated(io.BytesIO(data), out, limits, stop_names=["out/**"])
    return result, out.getvalue()


def markers(clean: bytes) -> dict[str, str]:
    """The clean tar's notes, by the name each stands for; the notes themselves are numbered, in order."""
    with tarfile.open(fileobj=io.BytesIO(clean)) as tar:
        notes = [m for m in tar if SKIPPED_KEY in m.pax_headers]
    assert [m.name for m in notes] == [f"{NOTES_DIR}/{n}" for n in range(1, len(notes) + 1)]
    return {m.pax_headers[SKIPPED_NAME_KEY]: m.pax_headers[SKIPPED_KEY] for m in notes}


def test_clean_tar_is_rewritten_with_neutral_metadata() -> None:
    info = member("dist/app.whl")
    info.uid, info.uname, info.mode = 4242, "mallory", 0o4777
    data = tar_of([(member("./dist", tarfile.DIRTYPE), None), (info, b"wheel"), (member("report.xml"), b"<ok/>")])
    files, out = validate(data)
    assert [(f.path, f.size) for f in files] == [("dist/app.whl", 5), ("report.xml", 5)]
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["dist/app.whl", "report.xml"]  # directories come with their files
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
    (member("rubout\x7f\x7f.txt"), b"x", "control characters"),  # DEL: erases the shown name on a terminal
    (member("back\\slash"), b"x", "backslash"),
    (member("x" * 2000), b"x", "longer than"),
    (member(".git/hooks/post-checkout"), b"#!/bin/sh", "a .git path component"),
    (member(".GIT/config"), b"[core]", "a .git path component"),
    (member("big.bin"), b"\0" * 1001, "larger than 1000 bytes"),
])
def test_hostile_members_are_skipped_and_named_and_the_rest_comes_back(
        info: tarfile.TarInfo, data: bytes | None, why: str) -> None:
    result, clean = copied(tar_of([(member("ok.txt"), b"fine"), (info, data), (member("z.txt"), b"too")]))
    assert [(f.path, f.size) for f in result.files] == [("ok.txt", 4), ("z.txt", 3)]
    assert result.stopped is None and len(result.skipped) == 1
    name, reason = result.skipped[0]
    assert why in reason
    assert markers(clean) == {name: reason}


def test_total_size_skips_what_would_go_over() -> None:
    result, _ = copied(tar_of([(member(f"f{i}"), b"\0" * 400) for i in range(3)]))
    assert [f.path for f in result.files] == ["f0", "f1"]
    assert result.skipped == [("f2", "would take the artifacts over 1000 bytes in total")]


def test_too_many_members_end_the_transfer_keeping_what_came_before() -> None:
    result, clean = copied(tar_of([(member(f"f{i}"), b"") for i in range(11)]))
    assert len(result.files) == 10 and result.stopped == "more than 10 members"
    assert markers(clean) == {"out/**": "the artifact transfer ended early: more than 10 members"}


def test_duplicate_names_keep_the_first() -> None:
    result, clean = copied(tar_of([(member("a"), b"1"), (member("./a"), b"2")]))
    assert [(f.path, f.size) for f in result.files] == [("a", 1)]
    assert "appears twice" in result.skipped[0][1]
    with tarfile.open(fileobj=io.BytesIO(clean)) as tar:
        first = tar.getmembers()[0]  # the note on the repeat follows it, under a name of its own
        assert (first.name, tar.extractfile(first).read()) == ("a", b"1")


def test_member_below_a_file_is_skipped() -> None:
    result, _ = copied(tar_of([(member("a"), b"1"), (member("a/b"), b"2")]))
    assert result.skipped == [("a/b", "its parent is a file")]


def unpack_trusting(clean: bytes, dest: Path) -> str | None:
    """What a client that trusts the service's clean tar may do: the standard library, no extraction
    filter (the only behaviour of tarfile before 3.12, and of 3.11.2 here). Why it stopped, or None."""
    trusting = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
    try:
        with tarfile.open(fileobj=io.BytesIO(clean)) as tar:
            tar.extractall(dest, **trusting)
    except OSError as exc:
        return str(exc)
    return None


def cut_short(name: str, size: int, sent: bytes) -> bytes:
    """A member whose header claims `size` bytes, of which the stream ends after `sent`."""
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(tarfile.PAX_FORMAT) + sent


def test_a_trusting_unpack_of_the_clean_tar_writes_only_its_files_inside_its_destination(tmp_path: Path) -> None:
    """Notes on what was left out were named by the guest (an absolute path, '..') or by the caller (its
    glob): unpacked with tarfile, a note truncated a file outside the destination or made one there; a
    note on a repeat truncated the copy kept, and a file named as a kept file's directory stopped the unpack.
    A member the stream cut short left its header and part of its data, with the notes inside its size."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    guest_note = member("../victim3.txt")
    guest_note.pax_headers = {SKIPPED_KEY: "left out in the VM: a socket"}
    hooks_note = member(".git/hooks/pre-commit")
    hooks_note.pax_headers = {SKIPPED_KEY: "left out in the VM: a socket"}
    guest = tar_of([
        (member(str(victim)), b"evil"), (member("../victim2.txt"), b"evil"), (guest_note, b""), (hooks_note, b""),
        (member("kept.txt"), b"fine"), (member("./kept.txt"), b"again"),
        (member("d/x"), b"in d"), (member("d"), b"a file where the unpack made a directory"),
        (member("link", tarfile.SYMTYPE, str(victim)), None), (member(f"{NOTES_DIR}/1"), b"a forged note"),
    ])
    guest = guest[:guest.rindex(b"a forged note") + 512] + cut_short("cut.bin", 900, b"x" * 100)  # no end blocks
    out = io.BytesIO()
    result = copy_validated(io.BytesIO(guest), out, Limits(max_files=20, max_file_bytes=1000, max_total_bytes=1000),
                            stop_names=["../glob-escape.txt", str(tmp_path / "glob.txt")])
    clean = out.getvalue()
    dest = tmp_path / "dest"
    dest.mkdir()

    stopped = unpack_trusting(clean, dest)
    assert victim.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "victim.txt"], "written outside the destination"
    assert stopped is None
    unpacked = {str(path.relative_to(dest)) for path in dest.rglob("*") if path.is_file()}
    assert unpacked == {"kept.txt", "d/x", *(f"{NOTES_DIR}/{n}" for n in range(1, 11))}
    kept = {f.path: (dest / f.path).read_bytes() for f in result.files}
    assert kept == {"kept.txt": b"fine", "d/x": b"in d"}
    notes = markers(clean)
    assert set(notes) == {str(victim), "../victim2.txt", "../victim3.txt", ".git/hooks/pre-commit", "kept.txt", "d",
                          f"{NOTES_DIR}/1", "link", "../glob-escape.txt", str(tmp_path / "glob.txt")}
    assert "absolute path" in notes[str(victim)] and "'..'" in notes["../victim2.txt"]
    assert notes["d"] == "an earlier file's directory has this name"
    assert notes[f"{NOTES_DIR}/1"] == f"{NOTES_DIR} is where the clean tar keeps its notes on what was left out"
    assert notes["../glob-escape.txt"] == ("the artifact transfer ended early: the stream ended inside the data "
                                           "of a member (924 bytes missing)")
    (tmp_path / "read-back").mkdir()
    read_back = extract(io.BytesIO(clean), tmp_path / "read-back")
    assert {name for name, _ in read_back.skipped} == set(notes), \
        "the host's own reader (the action's) names each note by what it stands for"


def test_a_guest_marker_is_passed_on() -> None:
    info = member("out/huge.bin")
    info.pax_headers = {SKIPPED_KEY: "left out in the VM: larger than the 100 bytes left"}
    result, clean = copied(tar_of([(info, b"")]))
    assert result.files == [] and markers(clean) == {"out/huge.bin": "left out in the VM: larger than the 100 bytes left"}


def test_truncated_and_garbage_streams() -> None:
    data = tar_of([(member("a"), b"y" * 900)])
    with pytest.raises(ArchiveError, match=r"^the stream ended inside the data of a member \(\d+ bytes missing\)$"):
        validate(data[:700])
    with pytest.raises(ArchiveError, match="corrupt tar header"):
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
    with pytest.raises(ArchiveError, match="not a valid tar archive: corrupt tar header at byte 0"):
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
