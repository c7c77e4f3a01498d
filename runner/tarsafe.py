"""Tar streams whose names and bytes a guest chose, handled on the host without trusting any of it.

The one place for the rules, used wherever a tar reaches the host from outside: `Sandbox.copy_out`,
the service's artifact check (`copy_validated`) and checkout check (`check_tar`), `microvm-check
run` and the action's artifact copy (`extract`).

- Every 512-byte header is read by `HeaderScanner` before `tarfile` sees it: pax, GNU long-name and
  long-link members over 64 KiB, global pax headers, sparse members, bad checksums and malformed pax
  records end the stream, and so do pax headers an unpatched tarfile would still search slowly
  (long runs of digits) or decode badly (a hdrcharset other than tarfile's own). stdlib `tarfile`
  reads an extended header whole and, before Python 3.11.10 / 3.12.6, parses it with backtracking
  regexes (CVE-2024-6232): a 1 MiB header cost minutes of CPU, a 32 MiB one hundreds of MiB of memory
  even when patched. A stream that ends inside a member's data ends there, for tarfile too.
- A member name is a plain relative path: UTF-8, no NUL or control characters, no backslash, not
  absolute, no `..`, bounded in length and depth, nothing the scanner would refuse when the name is
  written back as a pax record, and no `.git` component in any letter case or folded form (that is
  where git finds hooks and `core.fsmonitor`, which run on the next git command on the host).
- Only regular files and directories are ever written, by our own code: never a link, a device or a
  fifo. Directories are entered with O_NOFOLLOW and files are created with O_EXCL, so nothing already
  in the destination can redirect a write.
- A member that breaks a rule (a link, a device, an oversize file, a refused name, a repeat) is
  skipped and listed with the reason; the others still come through. Only a stream that is broken as
  a whole (framing, headers, the count or total bounds) raises `UnsafeTar`.
- The service's clean tar (`copy_validated`) is also read by clients that unpack it with plain
  `tarfile` and no filter (a review bot's download): its notes on what was left out are named
  NOTES_DIR/1, /2..., never by a name the guest or the caller chose, and no two of its members can
  collide when unpacked (a repeat, a file under a file, a file named as an earlier file's directory).

Python's tarfile extraction filters are not used: several of their bypasses were fixed only in later
patch releases than the ones Debian ships.
"""

from __future__ import annotations

import errno
import io
import math
import os
import posixpath
import re
import secrets
import sys
import tarfile
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO

from microvm_check.entries import Artifact
from runner.errors import ArchiveError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

COPY_CHUNK = 256 * 1024
BLOCK = 512
MAX_EXTENDED_BYTES = 64 * 1024  # a pax or GNU long-name/long-link header; real ones are a few hundred bytes
MAX_PENDING_MEMBERS = 4096  # headers the scanner has passed on that tarfile has not reported yet
# A zero-size member carrying this pax key stands for a file its producer left out, with the reason:
# the guest agent marks oversize files and specials this way, and the service passes on what it skipped.
SKIPPED_KEY = "MICROVM_CHECK.skipped"
# On the service's own markers: the name of what was left out (made printable), since the member is
# named NOTES_DIR/<number>. A name a guest chose may be absolute or hold '..': as a member's name,
# unpacking with plain tarfile would write it outside the destination.
SKIPPED_NAME_KEY = "MICROVM_CHECK.skipped_name"
NOTES_DIR = ".microvm-check-skipped"  # the clean tar's markers; a guest file there is refused
MAX_REASON_CHARS = 300

_DATA_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_NO_DATA_TYPES = (tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.DIRTYPE,
                  tarfile.FIFOTYPE)
_EXTENDED = {tarfile.XHDTYPE: "pax", tarfile.SOLARIS_XHDTYPE: "pax",
             tarfile.GNUTYPE_LONGNAME: "GNU long-name", tarfile.GNUTYPE_LONGLINK: "GNU long-link"}

HDRCHARSETS = (b"BINARY", b"ISO-IR 10646 2000 UTF-8")  # the two values POSIX defines, as tarfile writes them
MAX_DIGIT_COST = 1 << 16  # the sum of squared digit-run lengths in one pax header (see _unpatched_search_problem)
_DIGIT_RUN = re.compile(rb"[0-9]+")
_LONG_DIGIT_RUN = re.compile(r"[0-9]{41,}")

# The first releases whose tarfile no longer backtracks on pax headers (CVE-2024-6232), per minor.
PATCHED_PYTHON = {(3, 8): (3, 8, 20), (3, 9): (3, 9, 20), (3, 10): (3, 10, 15), (3, 11): (3, 11, 10),
                  (3, 12): (3, 12, 6)}


class UnsafeTar(ArchiveError):
    """The stream broke a rule or a bound; the message names the member and the rule."""


@dataclass(frozen=True)
class Limits:
    max_files: int = 10_000
    max_file_bytes: int = 1024**3
    max_total_bytes: int = 2 * 1024**3
    max_name_bytes: int = 1024
    max_depth: int = 32


@dataclass
class Extracted:
    files: list[Artifact] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name as given, why)
    total_bytes: int = 0  # of `files`, kept as they are added: re-summing per member is quadratic


# ---- Python itself ----------------------------------------------------------------------------


def python_problem(version: tuple[int, int, int] = sys.version_info[:3], module: object = tarfile) -> str | None:
    """Why this Python's tarfile is known to be unsafe on hostile pax headers, or None.

    A release at or past the fix is fine, and so is an older version number whose tarfile carries
    the fix (distributions backport it: Debian's 3.11.2-6+deb12u3 and later).
    """
    fixed = PATCHED_PYTHON.get(version[:2])
    if version[:2] < (3, 8) or (fixed is not None and version < fixed):
        if hasattr(module, "_header_length_prefix_re"):  # the upstream fix, backported
            return None
        want = " / ".join(".".join(map(str, v)) for v in PATCHED_PYTHON.values() if v[:2] >= (3, 11))
        return (f"Python {'.'.join(map(str, version))} has CVE-2024-6232 (tarfile parses pax headers with a "
                f"backtracking regex, so a guest's artifact tar could stall the service for minutes): run "
                f"microvm-check on Python {want} or later, or a distribution build with the fix "
                f"(Debian 12's python3.11 has it: recreate the venv with /usr/bin/python3 -m venv)")
    return None


ALLOW_UNPATCHED_ENV = "MICROVM_CHECK_ALLOW_UNPATCHED_PYTHON"


def require_patched_python(environ: dict[str, str] | None = None) -> None:
    """Refuse to start the service (or a run) on a Python whose tarfile is known to be unsafe.

    The header scanner already bounds every extended header at 64 KiB and passes on only
    well-formed pax records; this check keeps the second layer. Setting MICROVM_CHECK_ALLOW_UNPATCHED_PYTHON=1
    accepts such a Python anyway (development machines), with the scanner as the only layer.
    """
    problem = python_problem()
    if problem and (os.environ if environ is None else environ).get(ALLOW_UNPATCHED_ENV) != "1":
        from runner.errors import UserError

        raise UserError(f"{problem}; or set {ALLOW_UNPATCHED_ENV}=1 to accept it with only the tar header "
                        "scanner as protection")


# ---- names ------------------------------------------------------------------------------------


def safe_name(raw: str, limits: Limits = Limits()) -> str:
    """`raw` as a normalised relative path ("" for the archive's root), or UnsafeTar saying why not."""
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise UnsafeTar(f"member {raw[:80]!r}: control characters in the name")
    if "\\" in raw:
        raise UnsafeTar(f"member {raw[:80]!r}: backslash in the name")
    try:
        encoded = raw.encode("utf-8")
    except UnicodeEncodeError:  # tarfile's surrogateescape form of bytes that are not UTF-8
        raise UnsafeTar(f"member {_shown(raw)[:80]!r}: the name is not UTF-8 (the host's logs, summary "
                        "and outputs could not show it)") from None
    if len(encoded) > limits.max_name_bytes:
        raise UnsafeTar(f"member {raw[:80]!r}...: name longer than {limits.max_name_bytes} bytes")
    if raw.startswith("/"):
        raise UnsafeTar(f"member {raw[:80]!r}: absolute path")
    if "hdrcharset=" in raw or _digit_cost(encoded) > MAX_DIGIT_COST // 2:
        raise UnsafeTar(f"member {raw[:80]!r}: the name would make a pax header that the host's own tar "
                        "reader refuses (long runs of digits, or 'hdrcharset=')")
    parts = [part for part in raw.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeTar(f"member {raw[:80]!r}: '..' in the path")
    if len(parts) > limits.max_depth:
        raise UnsafeTar(f"member {raw[:80]!r}: deeper than {limits.max_depth} directories")
    if any(len(part.encode("utf-8")) > 255 for part in parts):
        raise UnsafeTar(f"member {raw[:80]!r}: a path component is longer than 255 bytes")
    return "/".join(parts)


# Unicode's Default_Ignorable_Code_Point: name-folding file systems (HFS+; ext4's casefold before
# Linux 6.12, as far as we know) drop them, and git's own core.protectHFS check skips them too.
_IGNORABLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3"
                        "\U0001d173-\U0001d17a\U000e0000-\U000e0fff]")


def refused_name(name: str) -> str | None:
    """Why a normalised name may never be written on the host, or None.

    `.git` in any letter case (case-insensitive file systems), with the trailing dots and spaces
    that Windows file systems drop, with ignorable code points anywhere and in compatibility forms
    (fullwidth letters): git runs hooks and `core.fsmonitor` from there.
    """
    for part in name.split("/"):
        if _folded(part) == ".git":
            return "a .git path component (git would run or trust what is in it): never written on the host"
    return None


def _folded(part: str) -> str:
    """A path component as name-folding file systems see it (see `refused_name`)."""
    return unicodedata.normalize("NFKC", _IGNORABLE.sub("", part)).casefold().rstrip(". ")


def kind_error(member: tarfile.TarInfo) -> str | None:
    """Why a member is not something we write (None for regular files and directories)."""
    if member.issym() or member.islnk():
        return f"links are not allowed (link to {member.linkname[:200]!r})"
    if member.ischr() or member.isblk():
        return "a device"
    if member.isfifo():
        return "a fifo"
    if member.issparse():
        return "sparse files are not allowed"
    if not (member.isreg() or member.isdir()):
        return f"unsupported member type {member.type!r}"
    return None


def skip_marker(member: tarfile.TarInfo) -> str | None:
    """The reason a producer gave for leaving this file out (a zero-size member with SKIPPED_KEY)."""
    why = member.pax_headers.get(SKIPPED_KEY)
    if why is None:
        return None
    return "".join(c if c.isprintable() else "?" for c in why[:MAX_REASON_CHARS]) or "left out, no reason given"


def marker(name: str, why: str, given: str | None = None) -> tarfile.TarInfo:
    """A zero-size member `name` that says a file was left out and why (see SKIPPED_KEY); `given` names
    that file when `name` does not (SKIPPED_NAME_KEY).

    All are made inert for the scanner that reads the marker back (no digit run over 40, no
    `hdrcharset=`): a guest chose them, and one refused header would end the whole stream.
    """
    info = tarfile.TarInfo(_inert(name))
    info.pax_headers = {SKIPPED_KEY: _inert(why[:MAX_REASON_CHARS])}
    if given is not None:
        info.pax_headers[SKIPPED_NAME_KEY] = _inert(_shown(given))
    return info


def noted_name(member: tarfile.TarInfo, name: str) -> str:
    """The name of the file a marker stands for: its SKIPPED_NAME_KEY (shown printable) when it has one,
    else `name`, the member's own. Only ever shown, never written."""
    given = member.pax_headers.get(SKIPPED_NAME_KEY)
    if given is None or SKIPPED_KEY not in member.pax_headers:
        return name
    return _shown(given)


def _inert(text: str) -> str:
    text = _LONG_DIGIT_RUN.sub(lambda run: run[0][:40] + "\u2026", text)
    return text.replace("hdrcharset=", "hdrcharset:")


# ---- the header scanner -----------------------------------------------------------------------


def _number(field_bytes: bytes, what: str) -> int:
    """A numeric header field as tarfile reads it (octal text, or GNU base-256); never negative."""
    if field_bytes[:1] in (b"\x80", b"\xff"):
        if field_bytes[:1] == b"\xff":
            raise UnsafeTar(f"negative {what} in a tar header")
        return int.from_bytes(field_bytes[1:], "big")
    text = field_bytes.split(b"\0", 1)[0].strip()
    if text and not all(48 <= c <= 55 for c in text):
        raise UnsafeTar(f"the {what} field of a tar header is not a number")
    return int(text or b"0", 8)


def _checksum_ok(block: bytes) -> bool:
    stored = _number(block[148:156], "checksum")
    if stored == 256 + sum(block[:148]) + sum(block[156:]):
        return True  # the usual case: the signed sum (a per-byte loop, 10x slower) only when needed
    return stored == 256 + sum(b - 256 if b > 127 else b for b in block[:148] + block[156:])


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def pax_records(body: bytes) -> dict[bytes, bytes]:
    """The records of a pax header ("LEN key=value\\n" each), strictly: anything else is refused.

    tarfile parses the whole block-padded body and stops at the first position where no record
    starts; requiring the rest to be NUL padding means it sees exactly the records seen here, all
    well formed, so its regex never backtracks on them. An unpatched tarfile also searches the whole
    body for `\\d+ hdrcharset=(...)\\n`, inside values too: `_unpatched_search_problem` keeps that
    search cheap and its find harmless.
    """
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(body) and body[pos] != 0:
        space = body.find(b" ", pos, pos + 21)
        if space <= pos or not body[pos:space].isdigit():
            raise UnsafeTar(f"malformed pax header record at byte {pos}")
        end = pos + int(body[pos:space])
        if end > len(body) or end < space + 3 or body[end - 1] != 0x0A:
            raise UnsafeTar(f"malformed pax header record at byte {pos}")
        key, eq, value = body[space + 1 : end - 1].partition(b"=")
        if not eq or not key:
            raise UnsafeTar(f"malformed pax header record at byte {pos}")
        records[key] = value
        pos = end
    if body[pos:].strip(b"\0"):
        raise UnsafeTar("bytes after the records of a pax header")
    if body.count(b"hdrcharset=") != (b"hdrcharset" in records) or records.get(b"hdrcharset", b"BINARY") not in HDRCHARSETS:
        raise UnsafeTar("a pax hdrcharset other than one record of BINARY or UTF-8")
    problem = _unpatched_search_problem(body)
    if problem:
        raise UnsafeTar(problem)
    return records


def _unpatched_search_problem(body: bytes) -> str | None:
    """Why the hdrcharset search of tarfile before 3.11.10 / 3.12.6 would be slow on `body`, or None.

    `\\d+ ` is tried at every digit of a run and scans to the run's end: n*n/2 steps for a run of n
    digits (a 64 KiB header of digits cost about 9 s). Real headers have runs of at most 20 (sizes,
    times, lengths); MAX_DIGIT_COST allows a 256-digit run, or many short ones.
    """
    if _digit_cost(body) > MAX_DIGIT_COST:
        return "a pax header with long runs of digits (an unpatched tarfile's regex backtracks on them)"
    return None


def _digit_cost(data: bytes) -> int:
    return sum(len(run) ** 2 for run in _DIGIT_RUN.findall(data))


class HeaderScanner(io.RawIOBase):
    """A tar stream passed on unchanged, with every header checked before anyone parses it.

    It walks the stream as tarfile does (header chains, member data, padding) and ends it with
    UnsafeTar on anything tarfile would read whole or that could make the two disagree on where a
    header starts. Memory is bounded by one extended header (64 KiB) plus one chunk, time by the
    stream's length. `confirm` cross-checks each member tarfile reports against the walk.
    """

    def __init__(self, raw: BinaryIO, max_extended: int = MAX_EXTENDED_BYTES) -> None:
        self._raw = raw
        self._max_extended = max_extended
        self._out = memoryview(b"")
        self._data_left = 0  # member data and padding to pass on before the next header
        self._offset = 0  # of the next byte read from `raw`
        self._ended = False
        self._chain: list[str] = []  # extended headers read for the member to come
        self._pax_size: int | None = None
        self._pending: dict[int, int] = {}  # data offset -> data bytes, per member passed on
        self._track = True  # record members for `confirm` (not when walking alone)
        self.members = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer)  # RawIOBase.read hands a bytearray or a memoryview of bytes
        while not self._out:
            if not self._advance(len(view)):
                return 0
        n = min(len(view), len(self._out))
        view[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def confirm(self, member: tarfile.TarInfo) -> None:
        """Check that tarfile found `member` where the walk put a member (else the stream ends)."""
        expected = self._pending.pop(member.offset_data, None)
        carries_data = member.isreg() or member.type not in tarfile.SUPPORTED_TYPES
        if expected is None or expected != (member.size if carries_data else 0):
            raise UnsafeTar(f"member {member.name[:80]!r}: the tar stream is ambiguous about where it starts")

    def skip_to_end(self) -> int:
        """Walk the rest of the stream without passing it on (seeking over data when possible); members."""
        self._track = False
        while self._advance(COPY_CHUNK, seek=True):
            self._out = memoryview(b"")
        return self.members

    def _advance(self, want: int, seek: bool = False) -> bool:
        if self._ended:
            return False
        if self._data_left:
            return self._pass_data(want, seek)
        block = self._read_exact(BLOCK)
        if not block:
            return False
        if len(block) < BLOCK:
            raise UnsafeTar("the stream ended inside a tar header")
        self._out = memoryview(self._header(block))
        return True

    def _pass_data(self, want: int, seek: bool) -> bool:
        if seek and self._raw.seekable():
            self._raw.seek(self._data_left, os.SEEK_CUR)
            self._offset += self._data_left
            self._data_left = 0
            return True
        chunk = self._raw.read(min(self._data_left, max(want, BLOCK), COPY_CHUNK))
        if not chunk:
            # Never report a plain end here: tarfile skips a member it was not asked to read with
            # one read per 10 KiB of its declared size, ended stream or not (a 10**15-byte claim spins
            # for days), and reports a short member no better than this.
            raise UnsafeTar(f"the stream ended inside the data of a member ({self._data_left} bytes missing)")
        self._offset += len(chunk)
        self._data_left -= len(chunk)
        self._out = memoryview(chunk)
        return True

    def _read_exact(self, size: int) -> bytes:
        parts, left = [], size
        while left:
            chunk = self._raw.read(left)
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
        data = b"".join(parts)
        self._offset += len(data)
        return data

    def _header(self, block: bytes) -> bytes:
        if block.count(0) == BLOCK:
            self._ended = True  # tarfile stops at the first zero block, and so does the walk
            return block
        try:
            intact = _checksum_ok(block)
        except UnsafeTar:
            intact = False
        if not intact:
            raise UnsafeTar(f"corrupt tar header at byte {self._offset - BLOCK}")
        kind, size = block[156:157], _number(block[124:136], "size")
        if kind in _EXTENDED:
            return block + self._extended(kind, size)
        if kind == tarfile.XGLTYPE:
            raise UnsafeTar("global pax headers are not accepted")
        if kind == tarfile.GNUTYPE_SPARSE:
            raise UnsafeTar("GNU sparse members are not accepted")
        if kind == tarfile.AREGTYPE and block[:100].split(b"\0", 1)[0].endswith(b"/"):
            kind = tarfile.DIRTYPE  # tarfile's reading of an old V7 directory
        data = 0 if kind in _NO_DATA_TYPES else (size if self._pax_size is None else self._pax_size)
        if self._track:
            if len(self._pending) >= MAX_PENDING_MEMBERS:
                raise UnsafeTar("the tar stream is ahead of its reader by too many members")
            self._pending[self._offset] = data
        self._chain, self._pax_size = [], None
        self._data_left = _padded(data)
        self.members += 1
        return block

    def _extended(self, kind: bytes, size: int) -> bytes:
        what = _EXTENDED[kind]
        if size > self._max_extended:
            raise UnsafeTar(f"a {what} header of {size} bytes (the limit is {self._max_extended}): refused "
                            "before parsing it")
        if what in self._chain:
            raise UnsafeTar(f"two {what} headers for one member")
        self._chain.append(what)
        body = self._read_exact(_padded(size))
        if len(body) < _padded(size):
            raise UnsafeTar(f"the stream ended inside a {what} header")
        if what == "pax":
            records = pax_records(body)
            if any(key.startswith(b"GNU.sparse.") for key in records):
                raise UnsafeTar("GNU sparse members are not accepted")
            if b"size" in records:
                value = records[b"size"]
                if not value.isdigit() or len(value) > 20:
                    raise UnsafeTar("a pax size that is not a number")
                self._pax_size = int(value)
        return body


def open_stream(stream: BinaryIO) -> tuple[HeaderScanner, tarfile.TarFile]:
    """tarfile in stream mode, reading through a HeaderScanner."""
    scanner = HeaderScanner(stream)
    try:
        return scanner, tarfile.open(fileobj=scanner, mode="r|", errorlevel=2)
    except tarfile.TarError as exc:
        raise UnsafeTar(f"not a valid tar stream: {exc}") from exc


def checked_members(stream: BinaryIO, max_files: int | None = None,
                    too_many: str = "") -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
    """Each member of an untrusted tar, once the header scanner agrees with tarfile on it, and at most
    `max_files` of them (`too_many` says so past that; None where the stream's size bounds it): the
    one walk every reader of such tars uses."""
    scanner, archive = open_stream(stream)
    with archive:
        for count, info in enumerate(archive, start=1):
            scanner.confirm(info)
            if max_files is not None and count > max_files:
                raise UnsafeTar(too_many)
            yield archive, info


def check_tar(src: BinaryIO) -> int:
    """Walk a tar's headers to reject garbage before a VM is spent on it; returns the member count.

    Only the scanner reads it (seeking over file data): a checkout within the size limit can hold
    millions of empty files, and keeping a TarInfo for each would cost about 0.4 KiB apiece.
    """
    scanner = HeaderScanner(src)
    try:
        count = scanner.skip_to_end()
    except UnsafeTar as exc:
        raise UnsafeTar(f"not a valid tar archive: {exc}") from exc
    if count == 0 and scanner._offset == 0:
        raise UnsafeTar("not a valid tar archive: empty file")
    if src.seekable() and src.seek(0, os.SEEK_END) < scanner._offset:  # the walk seeks over data past the end
        raise UnsafeTar("not a valid tar archive: it ends inside a member's data (cut short?)")
    return count


# ---- the service: guest tar -> clean tar --------------------------------------------------------


@dataclass
class Copied:
    """What `copy_validated` wrote, what it skipped and, if the stream broke, why it stopped."""

    files: list[Artifact] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    stopped: str | None = None


def copy_validated(src: BinaryIO, dst: BinaryIO, limits: Limits, stopped: str | None = None,
                   stop_names: Sequence[str] = ()) -> Copied:
    """Re-write the acceptable regular files of a guest tar into a clean tar with neutral metadata.

    Skipped members (links, devices, oversize, refused names, repeats) go into `dst` as markers, so
    whoever reads it can name them. A stream broken as a whole (or, per `stopped`, cut short before
    it got here) stops the copy: `stopped` says why, `dst` is still a complete tar of what came
    before, and each of `stop_names` (the requested globs) gets a marker saying the transfer ended.
    Markers are named NOTES_DIR/1, /2... with the name they stand for in SKIPPED_NAME_KEY. `dst` is a
    seekable file: a member whose data the stream cut short is taken back out of it whole.
    """
    done = Copied(stopped=stopped)
    state = _CopyState(limits)
    out = _CleanTar(dst)
    try:
        for source, info in checked_members(src, limits.max_files, f"more than {limits.max_files} members"):
            _copy_member(source, info, out, state, done)
    except UnsafeTar as exc:
        done.stopped = done.stopped or str(exc)
    except tarfile.TarError as exc:
        done.stopped = done.stopped or f"corrupt tar stream: {exc}"
    ended = [(name, f"the artifact transfer ended early: {done.stopped}") for name in stop_names if done.stopped]
    for number, (name, why) in enumerate([*done.skipped, *ended], start=1):
        out.add(marker(f"{NOTES_DIR}/{number}", why, given=name))
    out.close()
    return done


class _CleanTar:
    """The clean tar, written member by member: each whole or not at all.

    tarfile's `addfile` left the header and the first part of a member whose data ended early, so
    the members written after it (the notes) sat inside its declared size: a reader saw a file made of
    guest bytes and notes, and lost the notes. Here such a member is cut back off the file."""

    def __init__(self, dst: BinaryIO) -> None:
        self._dst = dst

    def add(self, info: tarfile.TarInfo, data: IO[bytes] | None = None) -> None:
        start = self._dst.tell()
        self._dst.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict"))
        if data is None:
            return
        try:
            copy_exact(data, self._dst, info.size)
        except BaseException:
            self._dst.seek(start)
            self._dst.truncate()
            raise
        self._dst.write(bytes(-info.size % BLOCK))

    def close(self) -> None:
        self._dst.write(bytes(2 * BLOCK))  # the end of the archive


@dataclass
class _CopyState:
    limits: Limits
    seen: set[str] = field(default_factory=set)  # the files written
    dirs: set[str] = field(default_factory=set)  # their parent directories
    total: int = 0


def _copy_member(source: tarfile.TarFile, info: tarfile.TarInfo, out: _CleanTar, state: _CopyState,
                 done: Copied) -> None:
    try:
        name = safe_name(info.name, state.limits)
    except UnsafeTar as exc:
        done.skipped.append((_shown(info.name), str(exc)))
        return
    if not name or info.isdir():
        return  # directories come with their files; the archive's root is nothing
    why = _member_problem(info, name, state)
    if why is not None:
        done.skipped.append((name, why))
        return
    clean = tarfile.TarInfo(name)
    clean.mtime = 0 if math.isnan(info.mtime) else int(max(0, min(info.mtime, 2**33)))  # pax mtime is a float
    clean.size, clean.mode = info.size, 0o755 if info.mode & 0o111 else 0o644
    data = source.extractfile(info)
    assert data is not None  # a regular file always has a reader
    out.add(clean, data)  # a short member ends the stream (UnsafeTar), and is not in `out`
    state.seen.add(name)
    state.dirs.update(_parents(name))
    state.total += info.size
    done.files.append(Artifact(name, info.size))


def _member_problem(info: tarfile.TarInfo, name: str, state: _CopyState) -> str | None:
    why = skip_marker(info) or kind_error(info) or refused_name(name)
    if why is not None:
        return why
    if _folded(name.split("/", 1)[0]) == NOTES_DIR:
        return f"{NOTES_DIR} is where the clean tar keeps its notes on what was left out"
    if name in state.seen:
        return "appears twice in the guest's tar (the first copy is kept)"
    if any(parent in state.seen for parent in _parents(name)):
        return "its parent is a file"
    if name in state.dirs:
        return "an earlier file's directory has this name"
    if info.size > state.limits.max_file_bytes:
        return f"larger than {state.limits.max_file_bytes} bytes"
    if state.total + info.size > state.limits.max_total_bytes:
        return f"would take the artifacts over {state.limits.max_total_bytes} bytes in total"
    return None


def _parents(name: str) -> Iterator[str]:
    """Each directory above `name`, nearest first ("a/b/c": "a/b", "a")."""
    parent = posixpath.dirname(name)
    while parent:
        yield parent
        parent = posixpath.dirname(parent)


def _shown(raw: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in raw[:200])


# ---- extraction on the host -------------------------------------------------------------------

Refuse = Callable[[str, tarfile.TarInfo], str | None]  # a caller's own reason to skip a member, or None


def extract(
    stream: BinaryIO,
    dest: Path,
    limits: Limits = Limits(),
    refuse: Refuse = lambda name, member: None,
) -> Extracted:
    """Write the acceptable members of `stream` under the existing directory `dest`.

    Members with unsafe names or types, over the per-file or total size, refused by `refuse` (which
    returns a reason), repeated, or blocked by what is already in `dest` are skipped and listed with
    the reason. The stream itself being broken, or the member count going over, raises UnsafeTar;
    what was extracted until then stays.
    """
    result = Extracted()
    seen: set[str] = set()
    dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        too_many = f"more than {limits.max_files} entries: stopped extracting"
        for archive, member in checked_members(stream, limits.max_files, too_many):
            _extract_member(archive, member, dest_fd, limits, refuse, result, seen)
    except tarfile.TarError as exc:
        raise UnsafeTar(f"not a valid tar stream: {exc}") from exc
    finally:
        os.close(dest_fd)
    return result


def _extract_member(
    archive: tarfile.TarFile,
    member: tarfile.TarInfo,
    dest_fd: int,
    limits: Limits,
    refuse: Refuse,
    result: Extracted,
    seen: set[str],
) -> None:
    try:
        name = safe_name(member.name, limits)
    except UnsafeTar as exc:
        result.skipped.append((_shown(member.name), str(exc)))
        return
    if not name:
        return  # the archive's own root
    why = _extract_problem(member, name, limits, refuse, result, seen)
    if why is not None:
        if not member.isdir():  # a refused directory is only a parent of refused files
            result.skipped.append((noted_name(member, name), why))
        return
    try:
        if member.isdir():
            os.close(open_dirs(dest_fd, name.split("/")))
            return
        source = archive.extractfile(member)
        assert source is not None  # regular members always have data
        _write_file(dest_fd, name, source, member.size, 0o755 if member.mode & 0o111 else 0o644)
    except OSError as exc:
        result.skipped.append((name, _why(exc)))
        return
    seen.add(name)
    result.files.append(Artifact(name, member.size))
    result.total_bytes += member.size


def _extract_problem(
    member: tarfile.TarInfo, name: str, limits: Limits, refuse: Refuse, result: Extracted, seen: set[str]
) -> str | None:
    why = skip_marker(member) or kind_error(member) or refused_name(name) or refuse(name, member)
    if why is not None or not member.isfile():
        return why
    if name in seen:
        return "appears twice in the stream (the first copy is kept)"
    if member.size > limits.max_file_bytes:
        return f"larger than {limits.max_file_bytes} bytes"
    if result.total_bytes + member.size > limits.max_total_bytes:
        return f"would take the files over {limits.max_total_bytes} bytes in total"
    return None


def open_dirs(dest_fd: int, parts: list[str]) -> int:
    """Open (creating) nested directories below dest_fd without following any symlink; an fd."""
    fd = os.dup(dest_fd)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def copy_exact(source: IO[bytes], out: BinaryIO, size: int) -> None:
    left = size
    while left:
        chunk = source.read(min(COPY_CHUNK, left))
        if not chunk:
            raise UnsafeTar("the stream ended inside a file")
        out.write(chunk)
        left -= len(chunk)


def _write_file(dest_fd: int, name: str, source: IO[bytes], size: int, mode: int) -> None:
    """Write to a fresh temporary name, then link it in only where nothing exists yet."""
    *dirs, base = name.split("/")
    dir_fd = open_dirs(dest_fd, dirs)
    tmp = f".{base[:200]}.mvc-{secrets.token_hex(6)}"
    try:
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            with os.fdopen(out_fd, "wb") as out:
                copy_exact(source, out, size)
                os.fchmod(out.fileno(), mode)
            os.link(tmp, base, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.unlink(tmp, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a parent in the destination is a symlink or not a directory"
    if exc.errno == errno.EEXIST:
        return "already exists in the destination (never overwritten)"
    return exc.strerror or str(exc)
