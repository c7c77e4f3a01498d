"""Test images, built from Python: an OCI image layout directory from layers described entry by entry, and a
local registry to push one to. No Docker needed; skopeo and Debian's docker-registry for the registry part.

    layout = write_layout(tmp_path / "img", [
        [Dir("bin"), File("bin/busybox", data, mode=0o755), Symlink("bin/sh", "busybox")],
        [Whiteout("bin/sh"), Opaque("etc")],
    ], env=("PATH=/bin",), workdir="/", user="")
    layout.ref            # "oci:/.../img:latest", for vmimages.oci.parse_ref
    with registry(tmp_path / "registry") as port:
        push(layout, port, "team/busybox", "1")  # docker://127.0.0.1:PORT/team/busybox:1

Entries: File, Dir, Symlink, Hardlink, Whiteout (`.wh.NAME`), Opaque (`.wh..wh..opq`), Device and Fifo (for
hostile images). `from_tree(path)` turns a directory on disk (a busybox-static tree, a debootstrap tree) into
entries, keeping modes, owners and links. A layer may also be given as raw bytes (a hand-made tar), with
`raw_media_type` for what it claims to be. `platforms=` makes an index with one image per platform.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import stat
import subprocess
import tarfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


@dataclass(frozen=True)
class File:
    name: str
    data: bytes | str = b""  # text is written as UTF-8
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 1_700_000_000


@dataclass(frozen=True)
class Dir:
    name: str
    mode: int = 0o755
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class Symlink:
    name: str
    target: str
    uid: int = 0
    gid: int = 0


@dataclass(frozen=True)
class Hardlink:
    name: str
    target: str  # a member name, as in the tar


@dataclass(frozen=True)
class Whiteout:
    name: str  # what to remove: "etc/motd" becomes the member "etc/.wh.motd"


@dataclass(frozen=True)
class Opaque:
    directory: str  # "" for the root: the member "<directory>/.wh..wh..opq"


@dataclass(frozen=True)
class Device:
    name: str
    kind: str = "c"  # "c" or "b"
    major: int = 1
    minor: int = 3


@dataclass(frozen=True)
class Fifo:
    name: str


Entry = File | Dir | Symlink | Hardlink | Whiteout | Opaque | Device | Fifo


def tar_info(entry: Entry) -> tuple[tarfile.TarInfo, bytes | None]:
    """The tar member for one entry, and its data (None for members without)."""
    if isinstance(entry, Whiteout):
        head, _, base = entry.name.rpartition("/")
        return tarfile.TarInfo(f"{head}/.wh.{base}" if head else f".wh.{base}"), b""
    if isinstance(entry, Opaque):
        return tarfile.TarInfo(f"{entry.directory}/.wh..wh..opq" if entry.directory else ".wh..wh..opq"), b""
    info = tarfile.TarInfo(entry.name)
    if isinstance(entry, File):
        data = entry.data.encode() if isinstance(entry.data, str) else entry.data
        info.size, info.mode, info.uid, info.gid, info.mtime = len(data), entry.mode, entry.uid, entry.gid, entry.mtime
        return info, data
    if isinstance(entry, Dir):
        info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, entry.mode, entry.uid, entry.gid
    elif isinstance(entry, Symlink):
        info.type, info.linkname, info.mode, info.uid, info.gid = tarfile.SYMTYPE, entry.target, 0o777, entry.uid, entry.gid
    elif isinstance(entry, Hardlink):
        info.type, info.linkname = tarfile.LNKTYPE, entry.target
    elif isinstance(entry, Device):
        info.type = tarfile.CHRTYPE if entry.kind == "c" else tarfile.BLKTYPE
        info.devmajor, info.devminor = entry.major, entry.minor
    elif isinstance(entry, Fifo):
        info.type = tarfile.FIFOTYPE
    return info, None


def layer_tar(entries: Sequence[Entry]) -> bytes:
    """An uncompressed layer tar of `entries`, in order (pax format, as image builders write)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info, data = tar_info(entry)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def from_tree(top: Path, under: str = "") -> list[Entry]:
    """Entries for a directory tree on disk (not `top` itself), links kept as links, modes and owners kept;
    a file seen again by inode becomes a Hardlink. `under` prefixes every name."""
    entries: list[Entry] = []
    inodes: dict[tuple[int, int], str] = {}
    for directory, dirs, files in os.walk(top):
        dirs.sort()
        for base in sorted(dirs) + sorted(files):
            path = Path(directory) / base
            name = (under.rstrip("/") + "/" if under else "") + path.relative_to(top).as_posix()
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                entries.append(Symlink(name, os.readlink(path), info.st_uid, info.st_gid))
            elif stat.S_ISDIR(info.st_mode):
                entries.append(Dir(name, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid))
            elif stat.S_ISREG(info.st_mode):
                key = (info.st_dev, info.st_ino)
                if info.st_nlink > 1 and key in inodes:
                    entries.append(Hardlink(name, inodes[key]))
                    continue
                inodes[key] = name
                entries.append(File(name, path.read_bytes(), stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid,
                                    int(info.st_mtime)))
    return entries


@dataclass(frozen=True)
class Layout:
    """An OCI layout written by `write_layout`: its directory, tag and the digest index.json points to."""

    path: Path
    tag: str
    digest: str  # the image manifest's, or the index's when there are several platforms
    layer_digests: tuple[str, ...]  # of the linux/amd64 image (or the first platform's)

    @property
    def ref(self) -> str:
        return f"oci:{self.path}:{self.tag}"

    def blob(self, digest: str) -> Path:
        return self.path / "blobs" / "sha256" / digest.removeprefix("sha256:")


def write_layout(path: Path, layers: Sequence[Sequence[Entry] | bytes], *, env: Sequence[str] = (),
                 workdir: str = "", user: str = "", compression: str = "gzip", raw_media_type: str = "",
                 platforms: Sequence[tuple[str, str]] | None = None, tag: str = "latest") -> Layout:
    """An OCI image layout at `path`: each layer an entry list (or raw tar bytes), gzip-compressed (or
    compression="" for plain tars); a config with Env/WorkingDir/User. With `platforms`, index.json points to
    an image index holding one image per (os, architecture), all with the same layers."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    blobs, diff_ids = [], []
    for layer in layers:
        tar = layer if isinstance(layer, bytes) else layer_tar(layer)
        diff_ids.append(_digest(tar))
        data = gzip.compress(tar, compresslevel=1, mtime=0) if compression == "gzip" else tar  # fast: tests build 100 MB layers
        media_type = raw_media_type or (OCI_LAYER + "+gzip" if compression == "gzip" else OCI_LAYER)
        blobs.append({"mediaType": media_type, "digest": _write_blob(path, data), "size": len(data)})
    manifests = []
    for os_name, arch in platforms or [("linux", "amd64")]:
        config = json.dumps({"architecture": arch, "os": os_name,
                             "config": {"Env": list(env), "WorkingDir": workdir, "User": user},
                             "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
        manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                               "config": {"mediaType": OCI_CONFIG, "digest": _write_blob(path, config),
                                          "size": len(config)},
                               "layers": blobs}).encode()
        manifests.append({"mediaType": OCI_MANIFEST, "digest": _write_blob(path, manifest), "size": len(manifest),
                          "platform": {"os": os_name, "architecture": arch}})
    top = manifests[0]
    if platforms is not None:
        index = json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}).encode()
        top = {"mediaType": OCI_INDEX, "digest": _write_blob(path, index), "size": len(index)}
    entry = {**{k: top[k] for k in ("mediaType", "digest", "size")},
             "annotations": {"org.opencontainers.image.ref.name": tag}}
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    return Layout(path, tag, str(top["digest"]), tuple(str(b["digest"]) for b in blobs))


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write_blob(layout: Path, data: bytes) -> str:
    digest = _digest(data)
    (layout / "blobs" / "sha256" / digest[7:]).write_bytes(data)
    return digest


# ---- a registry on 127.0.0.1 -----------------------------------------------------------------------------


@contextlib.contextmanager
def registry(storage: Path, binary: str = "/usr/bin/docker-registry") -> Iterator[int]:
    """Debian's docker-registry on 127.0.0.1, on a port the kernel chose (it listens on :0 and logs the
    address); storage in `storage`. Yields the port; stopped on exit."""
    storage.mkdir(parents=True, exist_ok=True)
    config = storage / "registry.yml"
    config.write_text(json.dumps({"version": 0.1, "log": {"level": "info"}, "http": {"addr": "127.0.0.1:0"},
                                  "storage": {"filesystem": {"rootdirectory": str(storage / "data")}}}))
    log = storage / "registry.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 30
        while (found := re.search(rb'listening on 127\.0\.0\.1:([0-9]+)', log.read_bytes())) is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield int(found[1])
    finally:
        server.terminate()
        server.wait(timeout=30)


def push(layout: Layout, port: int, name: str, tag: str) -> str:
    """Push `layout` (every platform) to the registry on 127.0.0.1:`port`; the docker:// reference."""
    target = f"docker://127.0.0.1:{port}/{name}:{tag}"
    subprocess.run(["skopeo", "--insecure-policy", "copy", "--all", "--quiet", "--dest-tls-verify=false",
                    f"oci:{layout.path}:{layout.tag}", target], check=True, capture_output=True, timeout=120)
    return target


def registry_blob(storage: Path, digest: str) -> Path:
    """Where the registry keeps a blob's bytes (distribution's filesystem driver)."""
    hexdigest = digest.removeprefix("sha256:")
    return storage / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexdigest[:2] / hexdigest / "data"
