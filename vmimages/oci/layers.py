"""Apply an image's layers, in order, into a root filesystem tree on the host: our own applier.

Why not umoci or a tar command: the tree is built by root on the build host from a stranger's tarball, so
every write must be one we can show stays inside `root`, and every bound must hold before the bytes it
bounds arrive. Here:

- Each layer blob is read once, streaming: hashed as it is read (its sha256 must be the one the manifest
  named, checked again at the end: nothing changes it between the fetch's check and this read unseen) and
  decompressed with the bytes out counted: gzip with Python's zlib, zstd with the host's `zstd -dc` piped
  and confined (confine.py), plain tar as it is.
- tar headers go through runner.tarsafe.HeaderScanner before tarfile parses them (no pax header over
  64 KiB, no sparse members, no stream that ends inside a member).
- Member names are normalised (a leading "./" dropped) and refused when absolute, holding "..", control
  characters, or past the length and depth bounds.
- Nothing is ever reached through a link: each parent directory is opened from `root` one component at a
  time with O_NOFOLLOW | O_DIRECTORY (created when missing); a parent that is a symlink or not a directory
  ends the apply ("member X goes through the link Y"). Symlinks are created as the image has them: their
  targets mean the guest's root and are never followed here. Hardlinks only point at a regular file already
  in the tree, reached the same way.
- What a member replaces is removed first (a directory with its whole tree, as OCI's applier does, except
  that a directory over a directory merges), then the new entry is created (regular files with O_EXCL).
- Owners are set without following links, then modes (chown clears set-id bits, so chmod comes after);
  regular files keep their mtime. Character and block devices are refused: the guest's /dev is a devtmpfs.
- Whiteouts (`.wh.NAME`) and opaque markers (`.wh..wh..opq`) remove what lower layers had, never what the
  same layer has, wherever the marker sits in the tar (the OCI image spec's rule).
- Bounds, over all layers: members and the directories made for their parents (ImageLimits.max_files),
  the files' apparent bytes (max_uncompressed_bytes, per member max_file_bytes), and the decompressed stream
  (max_stream_bytes). These are the applier's CPU and time bound too: it does a bounded amount of work per
  byte and per member, and holds a bounded amount of memory per member (16 bytes for its name).
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import math
import os
import posixpath
import shutil
import stat
import subprocess
import tarfile
import threading
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO, cast

from runner.errors import ArchiveError, ImageError
from runner.tarsafe import COPY_CHUNK, open_stream
from vmimages.oci import confine
from vmimages.oci.limits import ImageLimits

# layer media type -> compression ("" for a plain tar)
LAYER_MEDIA_TYPES = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
}
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
ZSTD_MEMORY = "--memory=128MB"  # zstd's own default bound on a frame's window, said explicitly
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Layer:
    """One layer blob of a fetched image, as its manifest describes it and verified against that."""

    path: Path
    media_type: str
    digest: str
    size: int


@dataclass(frozen=True)
class UnpackStats:
    """What the layers wrote: members applied (each file, directory, link, whiteout) and regular files' bytes."""

    files: int
    bytes: int


@dataclass
class _Budget:
    limits: ImageLimits
    members: int = 0
    bytes: int = 0
    stream: int = 0


@dataclass
class _LayerState:
    """One layer being applied: what it has put in the tree so far, and the directories above those, which
    its own whiteouts and opaque markers must leave alone."""

    what: str  # "layer 2 (sha256:...)" for messages
    touched: set[bytes] = field(default_factory=set)  # _key(name) of each


def apply_layers(layers: Sequence[Layer], root: Path, limits: ImageLimits) -> UnpackStats:
    """Apply `layers` in order into the existing directory `root` (the caller makes it inside a 0700
    root-owned directory and removes it on error). Runs as root to keep the image's owners. Raises
    ImageError naming the layer and member on the first thing refused; what was written until then stays
    in `root`, for the caller to remove."""
    budget = _Budget(limits)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        for number, layer in enumerate(layers, start=1):
            state = _LayerState(f"layer {number} ({layer.digest})")
            with _tar_stream(layer, budget, state.what) as stream:
                _apply_tar(cast(BinaryIO, stream), root_fd, state, budget)
    finally:
        os.close(root_fd)
    return UnpackStats(budget.members, budget.bytes)


# ---- the blob: hashed, decompressed, counted -----------------------------------------------------


class _Hashing(io.RawIOBase):
    """The layer blob as read, hashed on the way (whoever reads it: zlib, or the feed to zstd)."""

    def __init__(self, fd: int) -> None:
        self._file = os.fdopen(fd, "rb", buffering=0)
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        n = self._file.readinto(buffer)
        if n:
            self.sha.update(memoryview(buffer)[:n])
        return n or 0

    def drain(self) -> None:
        while self.read(COPY_CHUNK):
            pass

    def close(self) -> None:
        self._file.close()
        super().close()


class _Counted(io.RawIOBase):
    """The decompressed tar, with every byte counted against the image's stream bound."""

    def __init__(self, source: IO[bytes], budget: _Budget, what: str) -> None:
        self._source, self._budget, self._what = source, budget, what

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        view = memoryview(buffer)
        try:
            chunk = self._source.read(len(view))
        except (OSError, EOFError, zlib.error) as exc:
            raise ImageError(f"{self._what}: the compressed stream is corrupt ({exc}): the image is broken, "
                             "rebuild or re-push it") from None
        limit = self._budget.limits.max_stream_bytes
        self._budget.stream += len(chunk)
        if self._budget.stream > limit:
            raise ImageError(f"{self._what}: the layers decompress to more than {limit} bytes (tar headers "
                             "included): refused as a decompression bomb; raise ImageLimits.max_uncompressed_bytes "
                             "only for an image you trust")
        view[: len(chunk)] = chunk
        return len(chunk)

    def drain(self) -> None:
        while self.read(COPY_CHUNK):
            pass


def _open_blob(layer: Layer, what: str) -> _Hashing:
    fd = os.open(layer.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size != layer.size:
        os.close(fd)
        raise ImageError(f"{what}: the blob at {layer.path} is not a file of the manifest's {layer.size} bytes: "
                         "fetch the image again")
    return _Hashing(fd)


@contextmanager
def _tar_stream(layer: Layer, budget: _Budget, what: str) -> Iterator[_Counted]:
    """The layer's tar, decompressed and counted; on a clean exit, the rest of the stream is read (so a
    corrupt or truncated compression is an error) and the blob's digest compared."""
    compression = LAYER_MEDIA_TYPES.get(layer.media_type)
    if compression is None:
        raise ImageError(f"{what}: media type {layer.media_type[:100]!r} is not a layer type we apply")
    blob = _open_blob(layer, what)
    try:
        if compression == "zstd":
            with _zstd(blob, budget, what) as stream:
                yield stream
        else:
            source = gzip.GzipFile(fileobj=blob, mode="rb") if compression == "gzip" else blob
            stream = _Counted(cast(IO[bytes], source), budget, what)
            yield stream
            stream.drain()
        blob.drain()
        if "sha256:" + blob.sha.hexdigest() != layer.digest:
            raise ImageError(f"{what}: the blob's sha256 changed since the fetch verified it (sha256:"
                             f"{blob.sha.hexdigest()}): something else writes the fetch directory; fetch again")
    finally:
        blob.close()


@contextmanager
def _zstd(blob: _Hashing, budget: _Budget, what: str) -> Iterator[_Counted]:
    """`zstd -dc`, confined, fed the blob by a thread of ours (which hashes what it reads)."""
    home = Path("/")
    proc = subprocess.Popen([*confine.as_unprivileged(), confine.tool("zstd"), "-dcq", ZSTD_MEMORY],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=confine.minimal_env(home), cwd=home, start_new_session=True, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    feeder = threading.Thread(target=_feed, args=(blob, proc.stdin), daemon=True, name="zstd-feed")
    feeder.start()
    stream = _Counted(proc.stdout, budget, what)
    finished = False
    try:
        yield stream
        stream.drain()
        finished = True
    finally:
        if not finished:
            confine.kill_group(proc)
        feeder.join()
        proc.stdout.close()
        errors = proc.stderr.read(confine.STDERR_TAIL).decode("utf-8", "replace").strip()
        proc.stderr.close()
        status = proc.wait()
    if status != 0:
        raise ImageError(f"{what}: zstd could not decompress the layer (exit status {status}: {errors}): "
                         "the image is broken, rebuild or re-push it")


def _feed(blob: _Hashing, sink: IO[bytes]) -> None:
    try:
        while chunk := blob.read(COPY_CHUNK):
            sink.write(chunk)
    except (BrokenPipeError, ValueError, OSError):
        pass  # zstd ended (or was killed): the reader says why
    finally:
        try:
            sink.close()
        except OSError:
            pass


# ---- the tar: members into the tree --------------------------------------------------------------


def _apply_tar(stream: BinaryIO, root_fd: int, state: _LayerState, budget: _Budget) -> None:
    try:
        scanner, archive = open_stream(stream)
        with archive:
            while (member := archive.next()) is not None:
                scanner.confirm(member)
                _apply_member(archive, member, root_fd, state, budget)
                archive.members.clear()  # type: ignore[attr-defined]  # tarfile keeps each member read: 9 KiB with a long name
    except ArchiveError as exc:
        raise ImageError(f"{state.what}: {exc}: the layer is not a tar we accept") from None
    except tarfile.TarError as exc:
        raise ImageError(f"{state.what}: not a valid tar stream ({exc})") from None


def member_name(raw: str, limits: ImageLimits, what: str) -> str:
    """A member's name as a normalised relative path ("" for the root), or ImageError saying why not."""
    shown = f"{what}: member {raw[:200]!r}"
    if any(ord(c) < 32 or ord(c) == 127 for c in raw):
        raise ImageError(f"{shown}: control characters in the name; the image is not usable as a template")
    try:
        size = len(raw.encode("utf-8"))
    except UnicodeEncodeError:
        raise ImageError(f"{shown}: the name is not UTF-8; the image is not usable as a template") from None
    if size > limits.max_path_bytes:
        raise ImageError(f"{shown}...: name longer than {limits.max_path_bytes} bytes")
    name = raw[2:] if raw.startswith("./") else raw
    if name.startswith("/"):
        raise ImageError(f"{shown}: absolute path; a layer's names are relative to the image's root")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"{shown}: '..' in the path, which would reach outside the image's root")
    if len(parts) > limits.max_path_depth or any(len(part.encode("utf-8")) > 255 for part in parts):
        raise ImageError(f"{shown}: deeper than {limits.max_path_depth} directories or a component over 255 bytes")
    return "/".join(parts)


def _apply_member(archive: tarfile.TarFile, member: tarfile.TarInfo, root_fd: int, state: _LayerState,
                  budget: _Budget) -> None:
    name = member_name(member.name, budget.limits, state.what)
    shown = f"{state.what}: member {name[:200]!r}"
    _count(budget, shown)
    _check_numbers(member, shown)
    try:
        _apply_named(archive, member, name, root_fd, state, budget, shown)
    except OSError as exc:  # what the host's file system refuses (EMLINK, ENOSPC, ...): one line, not a traceback
        raise ImageError(f"{shown}: cannot be written ({exc.strerror or exc}): the image is not usable as a "
                         "template") from None


def _count(budget: _Budget, shown: str) -> None:
    """One more member, or one more directory made for a member's parents: both are entries on the host."""
    budget.members += 1
    if budget.members > budget.limits.max_files:
        raise ImageError(f"{shown}: more than {budget.limits.max_files} members in the image's layers (directories "
                         "made for a member's parents count too): refused; raise ImageLimits.max_files only for "
                         "an image you trust")


def _check_numbers(member: tarfile.TarInfo, shown: str) -> None:
    """Owners within uid_t (a pax uid or gid may be any number; -1 would mean "leave as is" to chown)."""
    if not all(isinstance(n, int) and 0 <= n < 2**32 - 1 for n in (member.uid, member.gid)):
        raise ImageError(f"{shown}: owner {str(member.uid)[:20]}:{str(member.gid)[:20]} is not a uid:gid the "
                         "guest can have")


def _apply_named(archive: tarfile.TarFile, member: tarfile.TarInfo, name: str, root_fd: int, state: _LayerState,
                 budget: _Budget, shown: str) -> None:
    limits = budget.limits
    if member.isreg():
        if member.size > limits.max_file_bytes:
            raise ImageError(f"{shown}: a file of {member.size} bytes, over the {limits.max_file_bytes} allowed "
                             "for one file")
        if budget.bytes + member.size > limits.max_uncompressed_bytes:
            raise ImageError(f"{shown}: its {member.size} bytes would take the image's files over "
                             f"{limits.max_uncompressed_bytes} bytes (apparent sizes)")
    base = posixpath.basename(name)
    if base.startswith(WHITEOUT):
        _whiteout(name, root_fd, state, shown, budget)
        return
    if not name:
        if member.isdir():
            _set_owner_mode(root_fd, None, member)
            return
        raise ImageError(f"{shown}: the image's root is not a directory")
    _check_kind(member, shown, limits)
    parent_fd = _open_parents(root_fd, name, create=budget, shown=shown)
    try:
        _create(archive, member, parent_fd, base, root_fd, shown, budget)
    finally:
        os.close(parent_fd)
    _touch(state, name)
    if member.isreg():
        budget.bytes += member.size


def _check_kind(member: tarfile.TarInfo, shown: str, limits: ImageLimits) -> None:
    if member.ischr() or member.isblk():
        raise ImageError(f"{shown}: a device node: refused (the guest's /dev is a devtmpfs, an image needs none); "
                         "rebuild the image without it")
    if member.issparse():
        raise ImageError(f"{shown}: a sparse file: refused")
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk() or member.isfifo()):
        raise ImageError(f"{shown}: unsupported tar member type {member.type!r}")
    if (member.issym() or member.islnk()) and (not member.linkname or "\0" in member.linkname
                                               or len(member.linkname.encode("utf-8", "surrogateescape"))
                                               > limits.max_path_bytes):
        raise ImageError(f"{shown}: a link target that is empty or longer than {limits.max_path_bytes} bytes")


def _create(archive: tarfile.TarFile, member: tarfile.TarInfo, parent_fd: int, base: str, root_fd: int,
            shown: str, budget: _Budget) -> None:
    existing = _lstat(parent_fd, base)
    if member.isdir():
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            _set_owner_mode(parent_fd, base, member)  # a directory over a directory: the contents merge
            return
        _remove(parent_fd, base, existing)
        os.mkdir(base, 0o700, dir_fd=parent_fd)
        _set_owner_mode(parent_fd, base, member)
    elif member.islnk():
        _hardlink(member, parent_fd, base, root_fd, shown, budget.limits)
    else:
        _remove(parent_fd, base, existing)
        if member.issym():
            os.symlink(member.linkname, base, dir_fd=parent_fd)
            os.chown(base, member.uid, member.gid, dir_fd=parent_fd, follow_symlinks=False)
        elif member.isfifo():
            os.mkfifo(base, 0o600, dir_fd=parent_fd)
            _set_owner_mode(parent_fd, base, member)
        else:
            _write_file(archive, member, parent_fd, base, shown)


def _write_file(archive: tarfile.TarFile, member: tarfile.TarInfo, parent_fd: int, base: str, shown: str) -> None:
    fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent_fd)
    with os.fdopen(fd, "wb") as out:
        source = archive.extractfile(member)
        assert source is not None  # a regular member always has a reader
        left = member.size
        while left:
            chunk = source.read(min(COPY_CHUNK, left))
            if not chunk:
                raise ImageError(f"{shown}: the layer ended inside this file's data: the image is broken")
            out.write(chunk)
            left -= len(chunk)
        os.fchown(fd, member.uid, member.gid)
        os.fchmod(fd, member.mode & 0o7777)  # after chown, which clears set-id bits
        if math.isfinite(member.mtime):  # a pax mtime is a float: nan and inf are left unset
            mtime = max(0, min(int(member.mtime), 2**33))
            os.utime(fd, (mtime, mtime))


def _hardlink(member: tarfile.TarInfo, parent_fd: int, base: str, root_fd: int, shown: str,
              limits: ImageLimits) -> None:
    """A hard link to a regular file already in the tree, reached without links."""
    target = member_name(member.linkname, limits, shown + ": hardlink target")
    if not target:
        raise ImageError(f"{shown}: a hardlink to the image's root")
    not_a_file = ImageError(f"{shown}: a hardlink to {target[:200]!r}, which is not a regular file in the image "
                            "(a hardlink may only name a file an earlier member made)")
    try:
        target_parent = _open_parents(root_fd, target, create=None, shown=f"{shown}: hardlink target {target[:200]!r}")
    except FileNotFoundError:
        raise not_a_file from None
    try:
        target_base = posixpath.basename(target)
        info = _lstat(target_parent, target_base)
        if info is None or not stat.S_ISREG(info.st_mode):
            raise not_a_file
        existing = _lstat(parent_fd, base)
        if existing is not None and (existing.st_dev, existing.st_ino) == (info.st_dev, info.st_ino):
            return  # already that file
        _remove(parent_fd, base, existing)
        if _lstat(target_parent, target_base) is None:  # it was in the directory just removed
            raise ImageError(f"{shown}: a hardlink to {target[:200]!r}, a file inside what it replaces")
        os.link(target_base, base, src_dir_fd=target_parent, dst_dir_fd=parent_fd, follow_symlinks=False)
    finally:
        os.close(target_parent)


def _set_owner_mode(parent_fd: int, base: str | None, member: tarfile.TarInfo) -> None:
    """chown then chmod (set-id bits survive), never through a link: `base` None is the directory itself."""
    if base is None:
        os.fchown(parent_fd, member.uid, member.gid)
        os.fchmod(parent_fd, member.mode & 0o7777)
        return
    os.chown(base, member.uid, member.gid, dir_fd=parent_fd, follow_symlinks=False)
    os.chmod(base, member.mode & 0o7777, dir_fd=parent_fd)  # base is a directory or fifo we just made or checked


# ---- paths: walked without links -------------------------------------------------------------------


def _open_parents(root_fd: int, name: str, *, create: _Budget | None, shown: str) -> int:
    """The directory holding `name`, opened from the root one component at a time without following links.
    With `create`, missing directories are made (0755, root's), each counted in that budget as a member (a
    deep name would otherwise make a hundred directories for one member). Without, a missing one raises
    FileNotFoundError. A symlink or a non-directory on the way is an ImageError."""
    fd = os.dup(root_fd)
    walked = ""
    try:
        for part in name.split("/")[:-1]:
            walked = f"{walked}/{part}" if walked else part
            if create is not None:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    _count(create, shown)
                except FileExistsError:
                    pass
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = _lstat(fd, part)
                kind = "the link" if info is not None and stat.S_ISLNK(info.st_mode) else "the non-directory"
                raise ImageError(f"{shown} goes through {kind} {walked[:200]!r}: never followed on the host; "
                                 "the image is not usable as a template") from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(dir_fd: int, base: str) -> os.stat_result | None:
    try:
        return os.stat(base, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _remove(parent_fd: int, base: str, existing: os.stat_result | None) -> None:
    """Remove what a lower layer had at `base`: a directory with its whole tree, never through a link."""
    if existing is None:
        return
    if stat.S_ISDIR(existing.st_mode):
        shutil.rmtree(base, dir_fd=parent_fd)  # fd-based on Linux: symlinks inside are removed, not followed
    else:
        os.unlink(base, dir_fd=parent_fd)


def _touch(state: _LayerState, name: str) -> None:
    """Record `name` and the directories above it as the layer's own (its whiteouts leave them)."""
    while name and (key := _key(name)) not in state.touched:
        state.touched.add(key)
        name = posixpath.dirname(name)


def _touched(state: _LayerState, name: str) -> bool:
    return _key(name) in state.touched


def _key(name: str) -> bytes:
    """A name as the layer's own-entries set keeps it: 16 bytes, whatever its length (up to 4 KiB per name
    times max_files would be gigabytes). A collision would only keep a lower layer's file from a whiteout."""
    return hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=16).digest()


# ---- whiteouts ---------------------------------------------------------------------------------------


def _whiteout(name: str, root_fd: int, state: _LayerState, shown: str, budget: _Budget) -> None:
    """`.wh.NAME` removes NAME as the lower layers left it; `.wh..wh..opq` empties its directory of what the
    lower layers put there. Other `.wh..wh.` names (aufs' own bookkeeping) are skipped."""
    directory, base = posixpath.split(name)
    opaque = base == OPAQUE
    if not opaque and base.startswith(WHITEOUT + WHITEOUT):
        return
    victim = base[len(WHITEOUT):]
    if not opaque and victim in ("", ".", ".."):
        raise ImageError(f"{shown}: a whiteout of {victim!r}, which names no entry of its directory")
    marker_dir = posixpath.join(directory, "x")  # _open_parents opens the directory holding its last component
    try:
        dir_fd = _open_parents(root_fd, marker_dir, create=budget if opaque else None, shown=shown)
    except FileNotFoundError:
        return  # nothing below to hide
    try:
        if opaque:
            _touch(state, directory)
            for entry in os.listdir(dir_fd):
                _remove_lower(dir_fd, entry, posixpath.join(directory, entry), state)
        else:
            _remove_lower(dir_fd, victim, posixpath.join(directory, victim), state)
    finally:
        os.close(dir_fd)


def _remove_lower(parent_fd: int, base: str, name: str, state: _LayerState) -> None:
    """Remove `name` except what this layer itself put at or below it."""
    existing = _lstat(parent_fd, base)
    if existing is None:
        return
    if not _touched(state, name):
        _remove(parent_fd, base, existing)
        return
    if not stat.S_ISDIR(existing.st_mode):
        return  # this layer's own file
    fd = os.open(base, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        for entry in os.listdir(fd):
            _remove_lower(fd, entry, posixpath.join(name, entry), state)
    finally:
        os.close(fd)
