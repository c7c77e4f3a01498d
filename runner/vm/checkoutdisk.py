"""A checkout as a disk: a tar unpacked on the host, made into an ext4 image, inserted in the VM's CD-ROM.

Unpacking a tar in the guest runs Python under software emulation (20-50 MB/s), and even the guest
kernel copies at only 30-60 MB/s there. So the host unpacks it, at native speed, builds a
journal-less ext4 image with `mkfs.ext4 -d`, and the guest mounts that image read-only with a
writable overlay over it at `dest`: nothing is copied in the guest, files are read from the
medium (QEMU's own I/O) as they are used.

Why a SCSI CD-ROM: every VM is restored from a template before its checkout exists, and PCI
hot-plug costs about 1.2 s under TCG, so the device must already be in the template with nothing
in it. A virtio-blk disk cannot be empty or change its medium; `scsi-cd` on virtio-scsi can
(`blockdev-change-medium`, the host opens the file and hands QEMU the descriptor: QEMU cannot open
host paths). Each insert is a new medium with a fresh filesystem UUID; the guest flushes the
device's buffers and checks that UUID in the superblock before it mounts, so it never reads stale
blocks of an earlier medium. The mounted medium stays in the drive for the VM's life: one
checkout per VM goes this way (`Sandbox.put_tar` sends any later tar through the agent).

The tar is read with `runner.tarsafe`'s header scanner and name rules, into a directory private
to the VM (root's, mode 0700). Unlike artifacts, a checkout keeps symbolic links, hard links and
modes: they only ever mean something inside the guest. On the host every directory is entered
with O_NOFOLLOW, every file is created with O_EXCL|O_NOFOLLOW and a link is only ever created,
never followed; `mkfs.ext4 -d` copies links as links. Set-id and sticky bits are dropped (a
set-uid file owned by root must not exist on the host even for a moment), devices and fifos are
refused. `.git` is written, unlike in artifacts: this tree is read by mkfs alone, never by git.

Every inode the unpacking makes counts against a budget from the tar's size (`inode_budget`),
directories a member's path only implies as much as those the archive lists: `a/b/.../z/f` makes
26 directories for one 512-byte header, so a 12 MiB tar of such paths could otherwise exhaust the
tmpfs's inodes for every user of it. The same count sizes mkfs's inode table (`-N`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

from runner import tarsafe
from runner.errors import SandboxOpFailed
from runner.vm.errors import SandboxError
from runner.vm.guestwire import CHECKOUT_DEVICE
from runner.vm.vm import VM

# The unpacked tree lives only until mkfs has read it: on tmpfs, where creating 20,000 small files
# takes a tenth of what it takes on a busy host disk.
STAGING_DIR = "/dev/shm"
STAGING_PREFIX = "microvm-check-checkout-"
BLOCK = 4096
INODE_BYTES = 256
TREE = "c"  # the checkout's directory inside the image: its root also holds mkfs's lost+found
MAX_LINK_TARGET = 4095  # PATH_MAX - 1: what the guest kernel accepts
NAME_LIMITS = tarsafe.Limits(max_name_bytes=4096, max_depth=256)
MKFS_TIMEOUT_S = 300.0
DEFAULT_TAR_BYTES = 1024**3  # the size assumed for a stream that cannot say (the service's default checkout limit)
TAR_HEADER = 512  # the least a member the archive lists costs in the tar
IMPLIED_PER_MEMBER = 1  # directories a member may imply beyond what it lists, on average
GUEST_TIMEOUT_S = 600.0


@dataclass
class Unpacked:
    """What a tar put in the tree, for the image's size."""

    files: int = 0
    dirs: int = 1
    links: int = 0
    data_blocks: int = 0
    root_given: bool = False  # the archive has a member for its root: its mode and time go to `dest`
    regular: dict[str, None] = field(default_factory=dict)  # names of regular files: hard link targets
    dir_modes: list[tuple[str, int, int]] = field(default_factory=list)  # set last, as tar does

    max_inodes: int | None = None  # the budget every new file, link and directory counts against
    known_dirs: set[str] = field(default_factory=lambda: {""})  # made so far, listed or implied

    def inodes(self) -> int:
        return self.files + self.dirs + self.links

    def made(self, what: str) -> None:
        """One more inode (`what` names it for the refusal): UnsafeTar past the budget."""
        if self.max_inodes is not None and self.inodes() > self.max_inodes:
            raise tarsafe.UnsafeTar(f"{what[:80]!r}: the archive makes more than {self.max_inodes} files, links "
                                    "and directories (counting directories its paths only imply), more than a "
                                    "tar of its size can hold")

    def directories(self, name: str) -> None:
        """Count the directories `name` and its parents that do not exist yet."""
        missing = []
        while name not in self.known_dirs:
            missing.append(name)
            name = name.rpartition("/")[0]
        for made in reversed(missing):
            self.known_dirs.add(made)
            self.dirs += 1
            self.made(made)


def inode_budget(tar_bytes: int) -> int:
    """Inodes a checkout tar of this size may make: one per 512-byte header it could hold, one implied
    directory each on average, and a few for the image's own."""
    return (1 + IMPLIED_PER_MEMBER) * (tar_bytes // TAR_HEADER) + 64


def unpack(stream: BinaryIO, tree: Path, max_inodes: int | None = None) -> Unpacked:
    """Write `stream`'s members under the new, empty directory `tree`; UnsafeTar on anything refused,
    and on more than `max_inodes` files, links and directories (None: the stream's size decides)."""
    if max_inodes is None:
        max_inodes = inode_budget(_size(stream))
    tree.mkdir(mode=0o700)
    result = Unpacked(max_inodes=max_inodes)
    root = os.open(tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    parents = _Parents(root, result)
    try:
        for archive, member in tarsafe.checked_members(stream):  # the checkout's size bounds the count
            _unpack_member(archive, member, parents, result)
        parents.close()
        for name, mode, mtime in reversed(result.dir_modes):  # last first: parents stay writable
            fd = parents.open(name)
            os.fchmod(fd, mode)
            os.utime(fd, (mtime, mtime))
            parents.close()
    except tarfile.TarError as exc:
        raise tarsafe.UnsafeTar(f"not a valid tar stream: {exc}") from exc
    finally:
        parents.close()
        os.close(root)
    return result


class _Parents:
    """The directory of the last member, kept open: a tar lists a directory's files together, and
    opening every path component again for each of 20,000 files is most of the unpacking time."""

    def __init__(self, root: int, result: Unpacked) -> None:
        self.root = root
        self._result = result
        self._name: str | None = None
        self._fd = -1

    def open(self, name: str) -> int:
        """The directory `name` ("" for the root), created if missing (each new one counted), never through a link."""
        if name != self._name:
            self.close()
            self._result.directories(name)
            self._fd = tarsafe.open_dirs(self.root, name.split("/") if name else [])
            self._name = name
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._name = -1, None


def _unpack_member(archive: tarfile.TarFile, member: tarfile.TarInfo, parents: _Parents, result: Unpacked) -> None:
    name = tarsafe.safe_name(member.name, NAME_LIMITS)
    mode = member.mode & 0o777  # no set-id or sticky bits on the host
    if member.isdir():
        if name:
            parents.open(name)
        result.root_given |= not name
        result.dir_modes.append((name, mode, int(member.mtime)))
        return
    if not name:
        raise tarsafe.UnsafeTar(f"member {member.name[:80]!r}: the archive's root is not a directory")
    directory, _, base = name.rpartition("/")
    parent = parents.open(directory)
    _replace(parent, base)
    if member.isreg():
        source = archive.extractfile(member)
        assert source is not None  # regular members always have data
        result.files += 1
        result.made(name)
        _write(parent, base, source, member.size, mode, int(member.mtime))
        result.data_blocks += -(-member.size // BLOCK)
        result.regular[name] = None
    elif member.issym():
        result.links += 1
        result.made(name)
        _symlink(parent, base, member.linkname)
        result.data_blocks += 1
    elif member.islnk():
        _hardlink(parents.root, parent, base, member.linkname, result)
    else:
        raise tarsafe.UnsafeTar(f"member {name[:80]!r}: {tarsafe.kind_error(member)}; a checkout holds "
                                "files, directories and links only")


def _replace(parent: int, base: str) -> None:
    """A later member of the same name wins, as with tar; a directory is never replaced by a file."""
    try:
        st = os.stat(base, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise tarsafe.UnsafeTar(f"member {base[:80]!r}: a file where the archive already has a directory")
    os.unlink(base, dir_fd=parent)


def _write(parent: int, base: str, source: IO[bytes], size: int, mode: int, mtime: int) -> None:
    fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
    with os.fdopen(fd, "wb") as out:
        tarsafe.copy_exact(source, out, size)
        os.fchmod(fd, mode)
        os.utime(fd, (mtime, mtime))


def _symlink(parent: int, base: str, target: str) -> None:
    if not target or "\0" in target or len(target.encode("utf-8", "surrogateescape")) > MAX_LINK_TARGET:
        raise tarsafe.UnsafeTar(f"member {base[:80]!r}: a link target that is empty or too long")
    os.symlink(target, base, dir_fd=parent)


def _hardlink(root: int, parent: int, base: str, target: str, result: Unpacked) -> None:
    """A hard link to a regular file this archive wrote before it (never to anything else)."""
    name = tarsafe.safe_name(target, NAME_LIMITS)
    if name not in result.regular:
        raise tarsafe.UnsafeTar(f"member {base[:80]!r}: a hard link to {target[:80]!r}, which is not an "
                                "earlier regular file of the archive")
    *dirs, source = name.split("/")
    source_dir = tarsafe.open_dirs(root, dirs)
    try:
        os.link(source, base, src_dir_fd=source_dir, dst_dir_fd=parent, follow_symlinks=False)
    finally:
        os.close(source_dir)


def image_bytes(unpacked: Unpacked) -> int:
    """A size that holds the tree: data and directory blocks, the inode tables, and slack for
    the per-group bitmaps and descriptors; unused space stays a hole in the file."""
    blocks = unpacked.data_blocks + unpacked.dirs * 2 + unpacked.inodes() * INODE_BYTES // BLOCK
    return (blocks + blocks // 8 + 1024) * BLOCK


def make_image(source: Path, image: Path, unpacked: Unpacked, label: str) -> None:
    """`mkfs.ext4 -d source`, no journal, owned by root, with `label` as its UUID."""
    size = image_bytes(unpacked)
    inodes = unpacked.inodes() + 64
    for attempt in range(2):
        image.unlink(missing_ok=True)
        proc = subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-b", str(BLOCK), "-I", str(INODE_BYTES), "-m", "0", "-N", str(inodes),
             "-O", "^has_journal,^resize_inode", "-U", label, "-E", "root_owner=0:0,nodiscard",
             "-d", str(source), str(image), str(size // 1024) + "k"],
            capture_output=True, text=True, timeout=MKFS_TIMEOUT_S, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
        if proc.returncode == 0:
            return
        if attempt == 0 and ("No space" in proc.stderr or "Could not allocate" in proc.stderr):
            size *= 2  # the estimate was short (many tiny directories): one more try, twice as big
            continue
        raise SandboxError(f"could not make the checkout's disk image: mkfs.ext4 said: {proc.stderr.strip()[-500:]}")


def staging_prefix(vm_name: str) -> str:
    """Staging directories carry their VM's name, so the start-up sweep that removes an orphaned VM
    (a service killed mid-unpack) can remove its staging on tmpfs too."""
    return f"{STAGING_PREFIX}{vm_name}-"


def remove_staging(vm_name: str) -> list[str]:
    """Delete what a VM of this name left on tmpfs; say what."""
    left = sorted(Path(STAGING_DIR).glob(f"{staging_prefix(vm_name)}*"))
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return [str(path) for path in left]


def mountable(dest: str) -> bool:
    """Whether `dest` can be the overlay's mount point: absolute, not the root, nothing that the
    overlay's option string would read as a separator."""
    return dest.startswith("/") and dest.strip("/") != "" and not any(c in dest for c in ",:\\")


def put_checkout(vm: VM, stream: BinaryIO, dest: str) -> None:
    """Unpack `stream` on the host, insert it as the VM's CD-ROM medium, have the guest copy it to `dest`."""
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(vm.dir.name), dir=STAGING_DIR))  # 0700, its own name
    image = vm.dir / f"checkout-{uuid.uuid4().hex[:8]}.img"
    try:
        try:
            unpacked = unpack(stream, staging / TREE)
        except (tarsafe.UnsafeTar, OSError) as exc:
            raise SandboxOpFailed(f"cannot unpack the tar stream into {dest}: {_why(exc)}") from None
        label = str(uuid.uuid4())
        make_image(staging, image, unpacked, label)
        shutil.rmtree(staging)
        vm.checkout_drive_used = True  # whatever happens next, the drive may hold this medium
        vm.machine.change_medium(image)
        message = {"op": "checkout", "device": CHECKOUT_DEVICE, "uuid": label, "dir": TREE, "dest": dest,
                   "root_given": unpacked.root_given}
        assert vm.agent is not None  # a VM is handed to a job only once its agent answered
        vm.agent.call(message, GUEST_TIMEOUT_S)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        image.unlink(missing_ok=True)  # QEMU keeps its descriptor until the next medium or its end


REHEARSAL_UUID = "6d766300-7265-6865-6172-73616c000000"  # fixed: the rehearsal medium is the same for every VM


def rehearsal_image(cache: Path) -> Path:
    """An empty checkout image, made once: what a pooled VM mounts once before any job needs it."""
    image = cache / "checkout-rehearsal.img"
    if not image.exists():
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=STAGING_DIR))
        try:
            (staging / TREE).mkdir()
            partial = image.with_name(f"{image.name}.{uuid.uuid4().hex[:8]}")
            make_image(staging, partial, Unpacked(), REHEARSAL_UUID)
            partial.rename(image)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return image


def rehearse(vm: VM, image: Path, timeout: float) -> None:
    """Insert, check, mount and unmount the rehearsal medium in a VM no job owns yet.

    Under TCG a restored clone translates every guest code path on its first use: the SCSI
    media change, the ext4 and overlay mounts cost 100-300 ms the first time and a fraction after.
    Paying that in the pool keeps it off the job's clock. The drive is left free, holding this
    medium unmounted; the job's checkout replaces it (and its UUID check tells the two apart)."""
    assert vm.agent is not None  # rehearsed after the agent's first answers (Engine._restore)
    vm.machine.change_medium(image)
    vm.agent.call({"op": "checkout", "device": CHECKOUT_DEVICE, "uuid": REHEARSAL_UUID, "dir": TREE,
                   "dest": "/run/microvm-check-rehearsal", "rehearsal": True}, timeout)


def _size(stream: BinaryIO) -> int:
    """The bytes left in a seekable stream (a spooled checkout); for a pipe, unknown: the default limit's."""
    try:
        here = stream.tell()
        end = stream.seek(0, os.SEEK_END)
        stream.seek(here)
    except (OSError, ValueError):
        return DEFAULT_TAR_BYTES
    return end - here


def _why(exc: Exception) -> str:
    if isinstance(exc, OSError) and exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a member's parent is a link or a file, not a directory"
    return str(exc)
