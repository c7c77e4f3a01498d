"""The host's rules for tar streams a guest produced (runner.tarsafe)."""

from __future__ import annotations

import io
import os
import tarfile
import tracemalloc
from pathlib import Path

import pytest

from microvm_check.entries import Artifact
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
    ("a\x00b", "control"), ("\x1b[2J", "control"), ("del\x7fname", "control"), ("\x7f", "control"),
    ("x" * 2000, "longer than"), ("/".join("d" * 40), "deeper"),
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
    assert [(f.path, f.size) for f in result.files] == [("ok/file.txt", 4)]
    assert {name for name, _ in result.skipped} == {"ok/link", "hard", "dev", "../escape"}
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["file.txt", "ok"]


@pytest.mark.parametrize("kind, link, why", [
    (tarfile.SYMTYPE, "/etc/shadow", "links are not allowed (link to '/etc/shadow')"),
    (tarfile.LNKTYPE, "a", "links are not allowed (link to 'a')"),
    (tarfile.CHRTYPE, "", "a device"), (tarfile.BLKTYPE, "", "a device"), (tarfile.FIFOTYPE, "", "a fifo"),
])
def test_a_link_device_or_fifo_is_refused_with_its_reason_and_the_rest_comes(
        tmp_path: Path, kind: bytes, link: str, why: str) -> None:
    """Letting symlinks through `kind_error` was caught only by tarfile's StreamError ending the whole
    stream (a symlink has no data to read), not by a test of the refusal."""
    special, _ = member("special", None, kind, link)
    assert tarsafe.kind_error(special) == why
    result = tarsafe.extract(tar_of(member("a", b"1"), (special, None), member("b", b"2")), tmp_path)
    assert [(f.path, f.size) for f in result.files] == [("a", 1), ("b", 1)] and result.skipped == [("special", why)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_symlink_already_in_the_destination_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(outside, dest / "sub")
    result = tarsafe.extract(tar_of(member("sub/planted", b"evil")), dest)
    assert [(f.path, f.size) for f in result.files] == [] and not (outside / "planted").exists()
    assert result.skipped[0][0] == "sub/planted"


def test_count_bombs_stop_early(tmp_path: Path) -> None:
    with pytest.raises(tarsafe.UnsafeTar, match="more than 3 entries"):
        tarsafe.extract(tar_of(*[member(f"f{i}") for i in range(10)]), tmp_path, tarsafe.Limits(max_files=3))
    assert len(list(tmp_path.iterdir())) == 3, "what came before the bound stays"


def test_a_file_over_the_total_is_skipped_and_the_rest_still_comes(tmp_path: Path) -> None:
    stream = tar_of(member("a", b"x" * 600), member("b", b"x" * 600), member("c", b"x" * 100))
    result = tarsafe.extract(stream, tmp_path, tarsafe.Limits(max_total_bytes=1000))
    assert [(f.path, f.size) for f in result.files] == [("a", 600), ("c", 100)]
    assert result.skipped == [("b", "would take the files over 1000 bytes in total")]


def test_exec_bit_is_kept_and_nothing_else(tmp_path: Path) -> None:
    info, data = member("run.sh", b"#!/bin/sh\n")
    info.mode = 0o4777
    tarsafe.extract(tar_of((info, data)), tmp_path)
    assert (tmp_path / "run.sh").stat().st_mode & 0o7777 == 0o755


def test_garbage_is_not_a_tar(tmp_path: Path) -> None:
    with pytest.raises(tarsafe.UnsafeTar, match="corrupt tar header at byte 0"):
        tarsafe.extract(io.BytesIO(b"garbage" * 300), tmp_path)


# ---- .git, repeats and existing files --------------------------------------------------------


@pytest.mark.parametrize("name", [".git/hooks/post-checkout", ".git/config", ".GIT/config", "sub/.Git/hooks/x",
                                  ".git", "a/.git./config", ".git /config"])
def test_git_components_are_refused_in_any_case(tmp_path: Path, name: str) -> None:
    result = tarsafe.extract(tar_of(member(name, b"#!/bin/sh\ntouch /tmp/pwned\n"), member("ok", b"1")), tmp_path)
    assert [(f.path, f.size) for f in result.files] == [("ok", 1)]
    assert result.skipped == [(name.rstrip("/"), tarsafe.refused_name(".git"))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]


def test_a_repeated_name_keeps_the_first_copy(tmp_path: Path) -> None:
    result = tarsafe.extract(tar_of(member("a", b"first"), member("./a", b"second")), tmp_path)
    assert (tmp_path / "a").read_bytes() == b"first"
    assert result.skipped == [("a", "appears twice in the stream (the first copy is kept)")]


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "keep").write_bytes(b"mine")
    result = tarsafe.extract(tar_of(member("keep", b"theirs")), tmp_path)
    assert (tmp_path / "keep").read_bytes() == b"mine"
    assert result.skipped == [("keep", "already exists in the destination (never overwritten)")]


def test_a_skip_marker_is_listed_with_its_reason(tmp_path: Path) -> None:
    info = tarsafe.marker("out/big.bin", "left out in the VM: larger than 10 bytes\x1b[2J")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info)
    buf.seek(0)
    result = tarsafe.extract(buf, tmp_path)
    assert [(f.path, f.size) for f in result.files] == [] and list(tmp_path.iterdir()) == []
    assert result.skipped == [("out/big.bin", "left out in the VM: larger than 10 bytes?[2J")]


# ---- the header scanner ---------------------------------------------------------------------


class Stream(io.RawIOBase):
    """A tar whose one extended header claims `size` bytes of `fill`, made as it is read: the test's own
    input never sits in memory, so the measured growth is the code's."""

    def __init__(self, kind: bytes, size: int, fill: bytes = b"1") -> None:
        header = tarfile.TarInfo("././@PaxHeader" if kind in (tarfile.XHDTYPE, tarfile.XGLTYPE) else "././@LongLink")
        header.type, header.size = kind, size
        self._head = header.tobuf(tarfile.USTAR_FORMAT)
        self._left = size
        self._fill = fill * (1 << 16)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n], self._head = self._head[:n], self._head[n:]
            return n
        n = min(len(buffer), self._left, len(self._fill))
        buffer[:n] = self._fill[:n]
        self._left -= n
        return n


def peak_growth(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("size", [1 << 20, 32 << 20])
@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK])
def test_huge_extended_headers_are_refused_before_parsing_in_bounded_memory(
        tmp_path: Path, size: int, kind: bytes) -> None:
    """CVE-2024-6232 and the 430 MiB growth per 32 MiB pax header: refused from the 512-byte header alone."""
    def run() -> None:
        with pytest.raises(tarsafe.UnsafeTar, match=f"header of {size} bytes \\(the limit is 65536\\): refused"):
            tarsafe.extract(Stream(kind, size, b"1 " if kind == tarfile.XHDTYPE else b"a"), tmp_path)
    assert peak_growth(run) < 8 * 1024 * 1024


def test_huge_headers_are_refused_by_the_service_side_too() -> None:
    out = io.BytesIO()
    def run() -> None:
        copied = tarsafe.copy_validated(Stream(tarfile.XHDTYPE, 32 << 20), out, tarsafe.Limits(), stop_names=["out/**"])
        assert copied.files == [] and "pax header of 33554432 bytes" in copied.stopped
    assert peak_growth(run) < 8 * 1024 * 1024
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:  # the clean tar still says why the transfer ended
        assert [(m.name, m.pax_headers[tarsafe.SKIPPED_NAME_KEY]) for m in tar] == [(f"{tarsafe.NOTES_DIR}/1", "out/**")]


def raw_tar(*blocks: tuple[bytes, bytes, bytes]) -> io.BytesIO:
    """Hand-made members (type, name, body): what a hostile guest could write, not what tarfile would."""
    out = b""
    for kind, name, body in blocks:
        info = tarfile.TarInfo(name.decode())
        info.type, info.size = kind, len(body)
        out += info.tobuf(tarfile.USTAR_FORMAT) + body + bytes(-len(body) % 512)
    return io.BytesIO(out + bytes(1024))


def pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    n = len(body) + 1
    while len(str(n).encode()) + len(body) != n:
        n += 1
    return str(n).encode() + body


@pytest.mark.parametrize("blocks,why", [
    ([(tarfile.XHDTYPE, b"h", b"9" * 5000 + b"x")], "malformed pax header record"),  # the CVE's shape, small
    ([(tarfile.XHDTYPE, b"h", pax_record(b"path", b"a") + b"junk")], "malformed pax header record"),
    ([(tarfile.XGLTYPE, b"g", pax_record(b"path", b"a"))], "global pax headers"),
    ([(tarfile.XHDTYPE, b"h", pax_record(b"GNU.sparse.map", b"0,1"))], "sparse"),
    ([(tarfile.XHDTYPE, b"h", pax_record(b"size", b"-1"))], "pax size that is not a number"),
    ([(tarfile.GNUTYPE_LONGNAME, b"L", b"a" * 100), (tarfile.GNUTYPE_LONGNAME, b"L", b"b" * 100)],
     "two GNU long-name headers"),
    ([(tarfile.GNUTYPE_SPARSE, b"s", b"")], "sparse"),
])
def test_headers_tarfile_would_mis_parse_end_the_stream(tmp_path: Path, blocks: list, why: str) -> None:
    with pytest.raises(tarsafe.UnsafeTar, match=why):
        tarsafe.extract(raw_tar(*blocks, (tarfile.REGTYPE, b"f", b"data")), tmp_path)


def test_a_pax_size_override_keeps_the_walk_in_step(tmp_path: Path) -> None:
    """The pax `size` decides where the next header is, for tarfile and for the scanner alike."""
    stream = raw_tar((tarfile.XHDTYPE, b"h", pax_record(b"size", b"600")), (tarfile.REGTYPE, b"f", b""))
    data = stream.getvalue()[:-1024] + b"y" * 600 + bytes(424)
    file_two = tarfile.TarInfo("g")
    file_two.size = 2
    data += file_two.tobuf(tarfile.USTAR_FORMAT) + b"ok" + bytes(510) + bytes(1024)
    result = tarsafe.extract(io.BytesIO(data), tmp_path)
    assert [(f.path, f.size) for f in result.files] == [("f", 600), ("g", 2)]


def test_a_corrupt_header_ends_the_stream(tmp_path: Path) -> None:
    data = bytearray(tar_of(member("a", b"1"), member("b", b"2")).getvalue())
    data[1024 + 148] ^= 1  # b's checksum
    with pytest.raises(tarsafe.UnsafeTar, match="corrupt tar header at byte 1024"):
        tarsafe.extract(io.BytesIO(bytes(data)), tmp_path)


def test_check_tar_walks_without_tarfile_and_refuses_huge_headers() -> None:
    assert tarsafe.check_tar(tar_of(member("a"), member("b" * 300), member("d", None, tarfile.DIRTYPE))) == 3
    with pytest.raises(tarsafe.UnsafeTar, match="not a valid tar archive: a pax header of 1048576 bytes"):
        tarsafe.check_tar(Stream(tarfile.XHDTYPE, 1 << 20))


# ---- the Python it runs on ------------------------------------------------------------------


@pytest.mark.parametrize("version,fixed,problem", [
    ((3, 11, 7), False, True), ((3, 11, 10), False, False), ((3, 12, 5), False, True), ((3, 12, 6), False, False),
    ((3, 13, 0), False, False), ((3, 11, 2), True, False), ((3, 10, 14), False, True),
])
def test_known_vulnerable_pythons_are_named(version: tuple, fixed: bool, problem: bool) -> None:
    module = type("tarfile", (), {"_header_length_prefix_re": None} if fixed else {})
    assert (tarsafe.python_problem(version, module) is not None) is problem


def test_serve_and_run_refuse_a_vulnerable_python(monkeypatch) -> None:
    from runner.errors import UserError

    monkeypatch.setattr(tarsafe, "python_problem", lambda: "Python 3.11.7 has CVE-2024-6232")
    with pytest.raises(UserError, match="CVE-2024-6232.*MICROVM_CHECK_ALLOW_UNPATCHED_PYTHON=1"):
        tarsafe.require_patched_python({})
    tarsafe.require_patched_python({"MICROVM_CHECK_ALLOW_UNPATCHED_PYTHON": "1"})
    from runner.commands import localrun
    from runner.service.host import cli

    monkeypatch.delenv("MICROVM_CHECK_ALLOW_UNPATCHED_PYTHON", raising=False)
    with pytest.raises(UserError, match="CVE-2024-6232"):
        cli.cmd_serve(None)
    with pytest.raises(UserError, match="CVE-2024-6232"):
        localrun.cmd_run(None)


# ---- hostile streams: where the scanner and tarfile could part ways ----------------------------


class Source(io.RawIOBase):
    """A guest's stream that counts how often it is read after it has ended."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)
        self.reads_past_end = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._data.readinto(buffer)
        self.reads_past_end += n == 0
        return n


def truncated_member(size: int) -> bytes:
    """One regular member that claims `size` bytes and brings 4 KiB: tarfile skips it by reading on."""
    info = tarfile.TarInfo("big.bin")
    info.size = size
    return info.tobuf(tarfile.USTAR_FORMAT) + b"x" * 4096


@pytest.mark.parametrize("side", ["extract", "copy_validated"])
def test_a_member_longer_than_the_stream_ends_it_instead_of_spinning(tmp_path: Path, side: str) -> None:
    """tarfile skips an unwanted member with `_Stream.seek`, one read per 10 KiB of the declared size
    even after the stream has ended: a 10**15-byte member (pax `size`) kept the service's job thread
    spinning for days. The scanner ends the stream at its real end instead."""
    source = Source(truncated_member(8 * 1024**3 - 1))
    if side == "extract":
        with pytest.raises(tarsafe.UnsafeTar, match="ended inside the data of a member"):
            tarsafe.extract(source, tmp_path, tarsafe.Limits(max_file_bytes=100))
    else:
        copied = tarsafe.copy_validated(source, io.BytesIO(), tarsafe.Limits(max_file_bytes=100))
        assert copied.files == [] and "ended inside the data of a member" in copied.stopped
    assert source.reads_past_end <= 2


@pytest.mark.parametrize("body", [
    pax_record(b"path", b"1" * 60000),  # one run: an unpatched tarfile spent about 9 s on this header
    b"".join(pax_record(b"comment", b"7" * 600) for _ in range(90)),
])
def test_long_digit_runs_in_a_pax_header_are_refused(body: bytes) -> None:
    """Before 3.11.10 / 3.12.6 tarfile looks for `\\d+ hdrcharset=` anywhere in a pax header, and a run
    of n digits costs it n*n/2 steps: within the 64 KiB bound, seconds per member, under the GIL."""
    with pytest.raises(tarsafe.UnsafeTar, match="runs of digits"):
        tarsafe.check_tar(raw_tar((tarfile.XHDTYPE, b"h", body), (tarfile.REGTYPE, b"f", b"data")))


@pytest.mark.parametrize("body", [
    pax_record(b"comment", b"1 hdrcharset=\xff"),  # found by tarfile's search inside another value
    pax_record(b"hdrcharset", b"\xff"),
    pax_record(b"hdrcharset", b"BINARY") + pax_record(b"path", b"x 1 hdrcharset=ISO-8859-1"),
])
def test_a_hdrcharset_other_than_tarfiles_own_is_refused(tmp_path: Path, body: bytes) -> None:
    """An unpatched tarfile decodes the first `\\d+ hdrcharset=` it finds anywhere in the header with
    strict UTF-8: the UnicodeDecodeError escaped every handler and failed the job."""
    with pytest.raises(tarsafe.UnsafeTar, match="hdrcharset"):
        tarsafe.extract(raw_tar((tarfile.XHDTYPE, b"h", body), (tarfile.REGTYPE, b"f", b"data")), tmp_path)


def test_real_pax_headers_still_pass(tmp_path: Path) -> None:
    """What tarfile and the guest agent write: times with fractions, long digit-laden names, BINARY."""
    name = "out/build-" + "20261130" * 5 + "/r\u00e9sum\u00e9.txt"
    info = tarfile.TarInfo(name)
    info.size, info.mtime = 2, 1732000000.123456
    buf = io.BytesIO()
    tar = tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT)
    tar.addfile(info, io.BytesIO(b"ok"))
    tar.addfile(tarsafe.marker("out/big", "left out in the VM: larger than 1000000000000 bytes"))
    body = pax_record(b"hdrcharset", b"BINARY") + pax_record(b"path", "x\u00e9".encode()) + pax_record(b"mtime", b"1.5")
    stream = io.BytesIO(buf.getvalue() + raw_tar((tarfile.XHDTYPE, b"h", body), (tarfile.REGTYPE, b"f", b"data")).getvalue())
    result = tarsafe.extract(stream, tmp_path)
    assert [(f.path, f.size) for f in result.files] == [(name, 2), ("x\u00e9", 4)]
    assert result.skipped == [("out/big", "left out in the VM: larger than 1000000000000 bytes")]


@pytest.mark.parametrize("mtime,kept", [(b"nan", 0), (b"inf", 2**33), (b"-inf", 0), (b"1e400", 2**33)])
def test_a_non_finite_pax_mtime_is_clamped_not_a_crash(mtime: bytes, kept: int) -> None:
    """tarfile reads a pax mtime with float(): int() of it raised ValueError/OverflowError out of the
    copy, which failed the job and lost the command's exit code."""
    out = io.BytesIO()
    stream = raw_tar((tarfile.XHDTYPE, b"h", pax_record(b"mtime", mtime)), (tarfile.REGTYPE, b"f", b"data"))
    copied = tarsafe.copy_validated(stream, out, tarsafe.Limits())
    assert copied.files == [Artifact("f", 4)] and copied.stopped is None
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        assert [m.mtime for m in tar] == [kept]


def non_utf8_tar() -> io.BytesIO:
    """What the guest agent writes for files whose names are not UTF-8 (legal on Linux): BINARY pax paths."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(os.fsdecode(b"out/r\xe9sum\xe9.txt"))
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
        link = tarfile.TarInfo(os.fsdecode(b"out/l\xe9nk"))
        link.type, link.linkname = tarfile.SYMTYPE, "x"
        tar.addfile(link)
        ok, data = member("out/ok.txt", b"ok")
        tar.addfile(ok, io.BytesIO(data))
    buf.seek(0)
    return buf


def test_names_that_are_not_utf8_are_skipped_and_shown_printable(tmp_path: Path) -> None:
    """Such a name became a str with lone surrogates: the service's log note about it and the action's
    job summary raised UnicodeEncodeError (job failed, step 'internal error')."""
    result = tarsafe.extract(non_utf8_tar(), tmp_path)
    assert [(f.path, f.size) for f in result.files] == [("out/ok.txt", 2)]
    assert [name for name, _ in result.skipped] == ["out/r?sum?.txt", "out/l?nk"]
    assert all("not UTF-8" in why for _, why in result.skipped)
    copied = tarsafe.copy_validated(non_utf8_tar(), io.BytesIO(), tarsafe.Limits())
    assert copied.files == [Artifact("out/ok.txt", 2)]
    for name, why in copied.skipped:
        f"{name}: {why}".encode()


@pytest.mark.parametrize("name", [
    ".g\u200cit/hooks/post-checkout", "\ufeff.git/config", "out/.GIT\u200d/config", ".g\u00adit/x",
    "\uff0e\uff47\uff49\uff54/config", ".git\uff0e/config", ".Git \u200b/config",
])
def test_git_hidden_behind_ignorable_or_compatibility_characters_is_refused(tmp_path: Path, name: str) -> None:
    """File systems that fold names (HFS+, case-folding ext4 directories on older kernels) drop the
    Unicode ignorables, as git's own core.protectHFS check does: `.g<ZWNJ>it` is `.git` there."""
    assert tarsafe.refused_name(name) is not None
    result = tarsafe.extract(tar_of(member(name, b"x"), member("fine/.gitignore", b"*")), tmp_path)
    assert [(f.path, f.size) for f in result.files] == [("fine/.gitignore", 1)] and result.skipped[0][0] == name


@pytest.mark.parametrize("name", [".gitignore", ".github/workflows/x", "git/config", "a.git/b", ".gi"])
def test_names_that_only_look_like_git_are_kept(name: str) -> None:
    assert tarsafe.refused_name(name) is None


def test_the_services_clean_tar_always_passes_the_actions_scanner(tmp_path: Path) -> None:
    """Names (through GNU long-name headers, which carry no pax records) and marker reasons a guest
    chose became pax records of the service's own clean tar; long digit runs or `hdrcharset=` in them
    made the action refuse the whole clean tar, every good artifact with it."""
    guest = raw_tar(
        (tarfile.GNUTYPE_LONGNAME, b"././@LongLink", b"1" * 200 + b"/" + b"2" * 200 + b"\0"), (tarfile.REGTYPE, b"x", b"ok"),
        (tarfile.REGTYPE, b"a hdrcharset=BINARY", b"ok"),
        (tarfile.GNUTYPE_LONGNAME, b"././@LongLink", b"3" * 180 + b"\0"),
        (tarfile.XHDTYPE, b"h", pax_record(tarsafe.SKIPPED_KEY.encode(), b"9" * 200)), (tarfile.REGTYPE, b"x", b""),
        (tarfile.REGTYPE, b"good.txt", b"ok"),
    )
    clean = io.BytesIO()
    copied = tarsafe.copy_validated(guest, clean, tarsafe.Limits())
    assert copied.stopped is None and copied.files == [Artifact("good.txt", 2)]
    assert len(copied.skipped) == 3
    clean.seek(0)
    result = tarsafe.extract(clean, tmp_path)
    assert [(f.path, f.size) for f in result.files] == [("good.txt", 2)] and len(result.skipped) == 3
