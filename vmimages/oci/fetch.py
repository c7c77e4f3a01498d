"""Fetch an OCI image into an OCI layout on the host, checked as the untrusted input it is.

The flow, from a reference to a root filesystem tree (the template build drives it):

1. `parse_ref` (reference.py): only docker://, oci: and oci-archive:, explicit host and tag or digest.
2. `fetch` (here): skopeo, confined (confine.py: nobody's uid, a minimal environment, a timeout, the bytes
   it writes watched), first reads the raw top manifest. A registry reference is pinned to that manifest's
   digest before anything else is fetched, so everything after is the same image even if the tag moves;
   an index without linux/amd64 is refused naming the platforms it has; the platform's manifest's declared
   sizes are checked against ImageLimits before a layer is downloaded. Then `skopeo copy` (which checks
   each blob's digest as it copies) writes an OCI layout, which is made root's and read again by our own
   code as untrusted (`verify_layout`): media types, sizes from descriptors checked before hashing, every
   blob's sha256 and size equal to its descriptor, the config parsed and bounded (config.py). Why both:
   skopeo's check covers the transfer, ours covers what is on our disk, in the formats and bounds we
   accept, whatever skopeo's version or the source's transport does.
3. `apply_layers` (layers.py): our own applier writes the layers into the caller's root directory, hashing
   each blob again as it reads it.

`FetchedImage.source_digest` is what to pin a docker:// reference to (`ref.pinned(digest)`): the template
records it and rebuilds from it unless asked to refresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runner.errors import ImageError
from vmimages.oci import confine
from vmimages.oci.config import ImageConfig, load_json, parse_config
from vmimages.oci.layers import LAYER_MEDIA_TYPES, Layer
from vmimages.oci.limits import DEFAULT_LIMITS, ImageLimits
from vmimages.oci.reference import DIGEST, DOCKER, OCI, ImageRef

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
CONFIG_TYPES = ("application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json")
FOREIGN_MARKS = ("nondistributable", "foreign")
TAG = "image"  # the one image in our layout
REF_NAME = "org.opencontainers.image.ref.name"
POLICY = {"default": [{"type": "insecureAcceptAnything"}]}  # trust is the digests': signatures are not checked
SOURCE_SLACK = 64 * 1024**2  # a local source's index, manifests and configs, over its layers

Say = Callable[[str], object]


@dataclass(frozen=True)
class FetchedImage:
    """An image in our layout, verified: its manifest's digest there, its config, its layer blobs in order.

    `source_digest` is the registry's digest of what the reference named (its index, when it has one; ""
    for local sources): pin to it, `ref.pinned(image.source_digest)`. `manifest_digest` is not for pinning:
    skopeo rewrites a Docker v2 manifest as an OCI one in our layout, so the registry has no such digest,
    and for an index it is one platform's manifest."""

    manifest_digest: str
    config: ImageConfig
    layers: tuple[Layer, ...]
    source_digest: str = ""


@dataclass(frozen=True)
class _Descriptor:
    media_type: str
    digest: str
    size: int


def fetch(ref: ImageRef, workdir: Path, limits: ImageLimits = DEFAULT_LIMITS, *, authfile: Path | None = None,
          registries_conf: Path | None = None, tls_verify: bool = True, say: Say = print) -> FetchedImage:
    """Fetch `ref` into `workdir`/fetch/layout and verify it. `workdir` is the caller's build directory, which
    uid 65534 must be able to enter when we run as root (skopeo runs as that uid); what is fetched stays
    in it, for the caller to remove. `authfile` is a containers-auth.json for the registry, `registries_conf`
    a containers-registries.conf (mirrors, insecure registries; else none of the host's is read): both are
    copied for skopeo's reading and removed after. `tls_verify=False` allows a plain-HTTP or self-signed
    registry."""
    base = _prepare(workdir, ref, limits)
    home, layout = base / "home", base / "layout"
    try:
        if authfile is not None:
            _copy_private(authfile, home / "auth.json", "the auth file")
        if registries_conf is not None:
            (home / "registries.conf").unlink()
            _copy_private(registries_conf, home / "registries.conf", "the registries.conf")
        skopeo = _Skopeo(base, home, limits, authfile is not None, tls_verify, str(ref))
        source = _source(ref, base, limits, say)
        say(f"fetching {ref} with skopeo")
        top = skopeo.raw(source)
        source_digest = _sha256(top)
        if ref.transport == DOCKER:
            source = str(ref.pinned(source_digest))
        expected = _precheck(skopeo, source, top, ref, limits)
        skopeo.copy(source, _helper_dir(layout))
    finally:
        shutil.rmtree(home, ignore_errors=True)  # the copy of the credentials, skopeo's own state
    _own(layout)
    image = verify_layout(layout, limits, what=str(ref))
    if expected is not None and tuple(layer.digest for layer in image.layers) != expected:
        raise ImageError(f"{ref}: skopeo wrote other layers than the manifest it was asked to copy: fetch again")
    say(f"{ref}: {len(image.layers)} layers verified ({sum(layer.size for layer in image.layers)} bytes)")
    return replace(image, source_digest=source_digest if ref.transport == DOCKER else "")


# ---- the work directory ----------------------------------------------------------------------------


def _prepare(workdir: Path, ref: ImageRef, limits: ImageLimits) -> Path:
    """workdir/fetch, fresh: root's and 0711 (the helper uid enters it, never writes in it), with home/ the
    helper's. Why root's: anything running as the helper uid (skopeo, zstd, another nobody process on the
    host) could otherwise plant a link where root then writes by path (raw.json, source/, layout/)."""
    uid = confine.helper_uid()
    blocked = _blocking_ancestor(workdir.resolve(), uid)
    if blocked is not None:
        raise ImageError(f"{ref}: skopeo runs as uid {uid} and cannot enter {blocked} (mode "
                         f"{stat.S_IMODE(blocked.stat().st_mode):o}) to reach {workdir}: give the fetch a directory "
                         "every user may enter (keep the root filesystem in a 0700 directory beside it)")
    base = workdir / "fetch"
    if base.is_symlink() or base.exists():
        shutil.rmtree(base)
    base.mkdir(mode=0o700)
    base.chmod(0o711)
    (base / "home").mkdir(mode=0o700)
    (base / "home" / "policy.json").write_text(json.dumps(POLICY))
    (base / "home" / "registries.conf").write_text("")  # no mirrors, aliases or short names of the host's
    for path in (base / "home", base / "home" / "policy.json", base / "home" / "registries.conf"):
        os.chown(path, uid, uid, follow_symlinks=False)
    return base


def _helper_dir(path: Path) -> Path:
    """A fresh directory the helper uid writes in (skopeo's layout), in our root-owned fetch directory."""
    path.mkdir(mode=0o700)
    os.chown(path, confine.helper_uid(), confine.helper_uid(), follow_symlinks=False)
    return path


def _blocking_ancestor(path: Path, uid: int) -> Path | None:
    for directory in [*reversed(path.parents), path]:
        info = directory.stat()
        if uid == info.st_uid and info.st_mode & 0o100 or uid == info.st_gid and info.st_mode & 0o010:
            continue
        if info.st_mode & 0o001 or uid == os.geteuid():
            continue
        return directory
    return None


def _copy_private(source: Path, target: Path, what: str) -> None:
    """A file of the host's (credentials, registry settings), readable by the helper uid alone, in skopeo's
    home (removed when it ends)."""
    data = _read_bounded(source, 1024**2, f"{what} {source}")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        os.fchown(out.fileno(), confine.helper_uid(), confine.helper_uid())


def _source(ref: ImageRef, base: Path, limits: ImageLimits, say: Say) -> str:
    """What skopeo reads: a registry reference as it is; a local layout or archive copied into our work
    directory first (skopeo's uid may not reach the caller's file, and a copy cannot change under it)."""
    if ref.transport == DOCKER:
        return str(ref)
    source = base / "source"
    source.mkdir(mode=0o700)  # root's: the helper reads it through its group (_share_tree), never writes
    budget = [limits.max_compressed_bytes + SOURCE_SLACK]
    if ref.transport == OCI:
        _copy_layout(Path(ref.path), source, budget, str(ref))
        target = f"oci:{source}" + (f":{ref.tag}" if ref.tag else "")
    else:
        _copy_file(Path(ref.path), source / "image.tar", budget, str(ref))
        target = f"oci-archive:{source / 'image.tar'}" + (f":{ref.tag}" if ref.tag else "")
    _share_tree(source)
    say(f"copied {ref} into {source}")
    return target


def _copy_layout(src: Path, dst: Path, budget: list[int], what: str) -> None:
    """An OCI layout's files (oci-layout, index.json, blobs/sha256/*), regular files only, never through a link."""
    _copy_file(src / "oci-layout", dst / "oci-layout", budget, what)
    _copy_file(src / "index.json", dst / "index.json", budget, what)
    blobs = src / "blobs" / "sha256"
    (dst / "blobs" / "sha256").mkdir(parents=True)
    fd = os.open(blobs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        names = os.listdir(fd)
    finally:
        os.close(fd)
    for name in names:
        if DIGEST.fullmatch(f"sha256:{name}"):
            _copy_file(blobs / name, dst / "blobs" / "sha256" / name, budget, what)


def _copy_file(src: Path, dst: Path, budget: list[int], what: str) -> None:
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError(f"{what}: cannot read {src}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as source:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ImageError(f"{what}: {src} is not a regular file")
        budget[0] -= info.st_size
        if budget[0] < 0:
            raise ImageError(f"{what}: the local image is larger than ImageLimits.max_compressed_bytes allows")
        with open(dst, "xb") as out:  # the size checked, no more: a file that grows meanwhile is cut there
            left = info.st_size
            while left > 0 and (chunk := source.read(min(left, 1024**2))):
                out.write(chunk)
                left -= len(chunk)


def _share_tree(top: Path) -> None:
    """Every file and directory under `top` (and `top`) readable by the helper uid through its group, still
    root's (so nothing the helper runs can change or replace them), never following a link."""
    if os.geteuid() != 0:
        return  # the helper is ourselves
    for directory, dirs, files in os.walk(top):
        for name, mode in [(".", 0o750)] + [(d, 0o750) for d in dirs] + [(f, 0o640) for f in files]:
            path = os.path.join(directory, name)
            os.chown(path, 0, confine.UNPRIVILEGED, follow_symlinks=False)
            os.chmod(path, mode)  # our own copies: directories and regular files only (_copy_layout)


def _own(layout: Path) -> None:
    """skopeo's output made root's and read-only before we read it, walked by file descriptor: until a
    directory of it is root's, anything running as the helper uid may rename, link or replace entries in it,
    so no name is followed and nothing is changed but what was opened and checked. Each directory is taken
    (root's, 0555) before it is listed, so its entries cannot change after; only directories and regular
    files of the helper's with one link are accepted (a hard link could be a host file). Nothing the helper
    runs can then change the layout's names; a blob's bytes, through a descriptor opened earlier, it still
    could: that is why layers.py hashes each blob again as it applies it."""
    try:
        fd = os.open(layout, _OPEN_DIR)
    except OSError as exc:
        raise ImageError(f"skopeo's layout {layout} is not a directory of its own ({exc.strerror}): refused") from None
    try:
        _own_dir(fd, str(layout))
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _own_dir(fd: int, shown: str) -> None:
    _take(fd, 0o555)
    for name in os.listdir(fd):
        path = os.path.join(shown, name)
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        refused = ImageError(f"skopeo left {path}, not a directory or a file of its own with one link, in its "
                             "layout: refused")
        if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
            raise refused
        try:
            child = os.open(name, _OPEN_DIR if stat.S_ISDIR(info.st_mode) else _OPEN_FILE, dir_fd=fd)
        except OSError:
            raise refused from None
        try:
            opened = os.fstat(child)
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                raise refused
            if stat.S_ISDIR(opened.st_mode):
                _own_dir(child, path)
            elif opened.st_nlink != 1 or opened.st_uid != confine.helper_uid():
                raise refused
            else:
                _take(child, 0o444)
        finally:
            os.close(child)


def _take(fd: int, mode: int) -> None:
    """The opened file or directory made root's (when we are root) with `mode`."""
    if os.geteuid() == 0:
        os.fchown(fd, 0, 0)
    os.fchmod(fd, mode)


# ---- skopeo ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Skopeo:
    base: Path
    home: Path
    limits: ImageLimits
    with_auth: bool
    tls_verify: bool
    what: str

    def _argv(self, command: str, *args: str) -> list[str]:
        # our own policy and registries.conf (skopeo 1.9 ignores CONTAINERS_REGISTRIES_CONF; the host's
        # registries.conf.d drop-ins, short-name aliases, are still read, and unused: references name their host)
        return [*confine.as_unprivileged(), confine.tool("skopeo"), "--policy", str(self.home / "policy.json"),
                "--registries-conf", str(self.home / "registries.conf"), "--registries.d", str(self.home),
                "--tmpdir", str(self.home), "--override-os", "linux", "--override-arch", "amd64", command, *args]

    def _env(self) -> dict[str, str]:
        return confine.minimal_env(self.home)

    def _auth(self, prefix: str) -> list[str]:
        auth = [f"--{prefix}authfile", str(self.home / "auth.json")] if self.with_auth else [f"--{prefix}no-creds"]
        # verified unless told: by us, or by the operator's registries.conf (`insecure = true`)
        return auth if self.tls_verify else [*auth, f"--{prefix}tls-verify=false"]

    def raw(self, source: str) -> bytes:
        """The raw manifest (or index) `source` names, bounded by ImageLimits.max_json_bytes."""
        out = self.base / "raw.json"
        out.unlink(missing_ok=True)
        argv = self._argv("inspect", "--raw", "--retry-times", "0", *self._auth(""), source)
        finished = confine.run(argv, env=self._env(), cwd=self.home, timeout=self.limits.fetch_timeout_seconds,
                               stdout=out, watch=lambda: self._over(out, self.limits.max_json_bytes),
                               what=f"{self.what}: skopeo inspect")
        if finished.returncode != 0:
            raise ImageError(f"{self.what}: skopeo could not read the image's manifest (exit status "
                             f"{finished.returncode}): {finished.stderr}")
        return _read_bounded(out, self.limits.max_json_bytes, f"{self.what}: the manifest")

    def copy(self, source: str, layout: Path) -> None:
        budget = self.limits.max_compressed_bytes + SOURCE_SLACK
        argv = self._argv("copy", "--retry-times", "0", *self._auth("src-"), source, f"oci:{layout}:{TAG}")
        finished = confine.run(argv, env=self._env(), cwd=self.home, timeout=self.limits.fetch_timeout_seconds,
                               watch=lambda: self._over(self.base, budget), what=f"{self.what}: skopeo copy")
        if finished.returncode != 0:
            raise ImageError(f"{self.what}: skopeo copy failed (exit status {finished.returncode}): "
                             f"{finished.stderr} (a blob whose bytes do not match its digest means a corrupt or "
                             "altered image; otherwise check the reference, the registry and its credentials)")

    def _over(self, path: Path, limit: int) -> str | None:
        used = _disk_bytes(path)
        return f"wrote more than {limit} bytes (ImageLimits): stopped" if used > limit else None


def _disk_bytes(top: Path) -> int:
    if top.is_file():
        return top.stat().st_size
    total = 0
    for directory, _dirs, files in os.walk(top):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _precheck(skopeo: _Skopeo, source: str, top: bytes, ref: ImageRef, limits: ImageLimits
              ) -> tuple[str, ...] | None:
    """Before any layer is copied: the platform's manifest and its declared sizes within the limits. Returns
    the layer digests skopeo must write (None for a local index, whose platform manifest skopeo picks)."""
    doc = _object(load_json(top, f"{ref}: the manifest"), f"{ref}: the manifest")
    media_type = doc.get("mediaType", "")
    if media_type in INDEX_TYPES or "manifests" in doc:
        descriptor = pick_platform(doc, str(ref))
        if ref.transport != DOCKER:
            return None
        raw = skopeo.raw(str(ref.pinned(descriptor.digest)))
        if _sha256(raw) != descriptor.digest or len(raw) != descriptor.size:
            raise ImageError(f"{ref}: the platform manifest {descriptor.digest} does not match its index entry")
        doc = _object(load_json(raw, f"{ref}: manifest {descriptor.digest}"), f"{ref}: the manifest")
    _config, layers = _manifest_parts(doc, str(ref), limits)
    return tuple(layer.digest for layer in layers)


# ---- the layout, read as untrusted ------------------------------------------------------------------


def verify_layout(layout: Path, limits: ImageLimits = DEFAULT_LIMITS, *, what: str = "the image") -> FetchedImage:
    """The linux/amd64 image of an OCI layout (the one tagged `image`, or its only one), every blob checked
    against its descriptor: size before reading, then sha256. Raises ImageError naming the blob."""
    index = _object(load_json(_read_bounded(layout / "index.json", limits.max_json_bytes, f"{what}: index.json"),
                              f"{what}: index.json"), f"{what}: index.json")
    descriptor = _tagged(index, what)
    if descriptor.media_type in INDEX_TYPES:
        nested = _object(load_json(_blob(layout, descriptor, limits.max_json_bytes, what), f"{what}: the index"),
                         f"{what}: the index")
        descriptor = pick_platform(nested, what)
    if descriptor.media_type not in MANIFEST_TYPES:
        raise ImageError(f"{what}: index.json names a {descriptor.media_type[:100]!r}, not an image manifest")
    raw = _blob(layout, descriptor, limits.max_json_bytes, what)
    manifest = _object(load_json(raw, f"{what}: manifest {descriptor.digest}"), f"{what}: the manifest")
    if manifest.get("mediaType", descriptor.media_type) != descriptor.media_type:
        raise ImageError(f"{what}: manifest {descriptor.digest} says it is a {str(manifest.get('mediaType'))[:100]!r}, "
                         f"its descriptor a {descriptor.media_type!r}")
    config_descriptor, layer_descriptors = _manifest_parts(manifest, what, limits)
    config = parse_config(_blob(layout, config_descriptor, limits.max_json_bytes, what),
                          f"{what}: config {config_descriptor.digest}")
    layers = []
    for layer in layer_descriptors:
        _hash_file(_blob_path(layout, layer.digest), layer, what)
        layers.append(Layer(_blob_path(layout, layer.digest), layer.media_type, layer.digest, layer.size))
    return FetchedImage(descriptor.digest, config, tuple(layers))


def _tagged(index: dict[str, Any], what: str) -> _Descriptor:
    entries = index.get("manifests")
    if index.get("schemaVersion") != 2 or not isinstance(entries, list) or not entries:
        raise ImageError(f"{what}: index.json lists no manifests (schemaVersion 2 and a \"manifests\" list expected)")
    tagged = [e for e in entries if isinstance(e, dict) and (e.get("annotations") or {}).get(REF_NAME) == TAG]
    if len(tagged) > 1 or (not tagged and len(entries) > 1):
        raise ImageError(f"{what}: index.json does not name one image tagged {TAG!r}")
    return _descriptor(tagged[0] if tagged else entries[0], what, "index.json's entry")


def pick_platform(index: dict[str, Any], what: str) -> _Descriptor:
    """The linux/amd64 manifest of an index or manifest list; else ImageError naming the platforms it has."""
    entries = index.get("manifests")
    if not isinstance(entries, list) or not entries or len(entries) > 1024:
        raise ImageError(f"{what}: the image index lists no manifests (or more than 1024)")
    platforms = []
    for entry in entries:
        platform = (entry.get("platform") if isinstance(entry, dict) else None) or {}
        os_name, arch = str(platform.get("os", "?"))[:40], str(platform.get("architecture", "?"))[:40]
        if (os_name, arch) == ("linux", "amd64"):
            found = _descriptor(entry, what, "the index's linux/amd64 entry")
            if found.media_type not in MANIFEST_TYPES:
                raise ImageError(f"{what}: the index's linux/amd64 entry is a {found.media_type[:100]!r}, not a manifest")
            return found
        platforms.append(f"{os_name}/{arch}")
    raise ImageError(f"{what}: the image has no linux/amd64 variant (it has {', '.join(sorted(set(platforms)))}): "
                     "templates run linux/amd64; use an image built for it")


def _manifest_parts(manifest: dict[str, Any], what: str, limits: ImageLimits
                    ) -> tuple[_Descriptor, tuple[_Descriptor, ...]]:
    if manifest.get("schemaVersion") != 2:
        raise ImageError(f"{what}: the manifest is not schemaVersion 2 (Docker schema 1 images are not accepted: "
                         "re-push the image with a current tool)")
    config = _descriptor(manifest.get("config"), what, "the manifest's config")
    if config.media_type not in CONFIG_TYPES:
        raise ImageError(f"{what}: config {config.digest} is a {config.media_type[:100]!r}, not an image config")
    if config.size > limits.max_json_bytes:
        raise ImageError(f"{what}: config {config.digest} is {config.size} bytes, over {limits.max_json_bytes}")
    entries = manifest.get("layers")
    if not isinstance(entries, list) or not entries:
        raise ImageError(f"{what}: the manifest lists no layers")
    if len(entries) > limits.max_layers:
        raise ImageError(f"{what}: {len(entries)} layers, over the {limits.max_layers} allowed (ImageLimits.max_layers)")
    layers = tuple(_descriptor(entry, what, f"layer {n}") for n, entry in enumerate(entries, start=1))
    for number, (entry, layer) in enumerate(zip(entries, layers), start=1):
        foreign = any(mark in layer.media_type for mark in FOREIGN_MARKS) or entry.get("urls")
        if foreign:
            raise ImageError(f"{what}: layer {number} ({layer.digest}) is a foreign or non-distributable layer "
                             "(fetched from URLs outside the registry): not accepted; use an image without one")
        if layer.media_type not in LAYER_MEDIA_TYPES:
            raise ImageError(f"{what}: layer {number} ({layer.digest}) has media type {layer.media_type[:100]!r}; "
                             f"accepted: {', '.join(LAYER_MEDIA_TYPES)}")
    total = sum(layer.size for layer in layers)
    if total > limits.max_compressed_bytes:
        raise ImageError(f"{what}: the layers are {total} bytes compressed, over the {limits.max_compressed_bytes} "
                         "allowed (ImageLimits.max_compressed_bytes)")
    return config, layers


def _descriptor(entry: object, what: str, which: str) -> _Descriptor:
    if not isinstance(entry, dict):
        raise ImageError(f"{what}: {which} is not a descriptor object")
    media_type, digest, size = entry.get("mediaType"), entry.get("digest"), entry.get("size")
    if not isinstance(media_type, str) or len(media_type) > 255:
        raise ImageError(f"{what}: {which} has no mediaType")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise ImageError(f"{what}: {which} has digest {str(digest)[:100]!r}: only sha256:<64 hex> digests are accepted")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ImageError(f"{what}: {which} ({digest}) has no valid size")
    return _Descriptor(media_type, digest, size)


def _blob_path(layout: Path, digest: str) -> Path:
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _blob(layout: Path, descriptor: _Descriptor, limit: int, what: str) -> bytes:
    """A JSON blob, its size checked against `limit` before reading and its bytes against the descriptor."""
    if descriptor.size > limit:
        raise ImageError(f"{what}: blob {descriptor.digest} is {descriptor.size} bytes, over {limit} (ImageLimits)")
    data = _read_bounded(_blob_path(layout, descriptor.digest), limit, f"{what}: blob {descriptor.digest}")
    if len(data) != descriptor.size or _sha256(data) != descriptor.digest:
        raise ImageError(f"{what}: blob {descriptor.digest} does not match its descriptor (size {len(data)}, "
                         f"{_sha256(data)}): the image is corrupt or was changed; fetch it again")
    return data


def _hash_file(path: Path, descriptor: _Descriptor, what: str) -> None:
    fd = _open_regular(path, f"{what}: blob {descriptor.digest}")
    with os.fdopen(fd, "rb") as blob:
        size = os.fstat(fd).st_size
        if size != descriptor.size:
            raise ImageError(f"{what}: blob {descriptor.digest} is {size} bytes, its descriptor says "
                             f"{descriptor.size}: the image is corrupt or was changed; fetch it again")
        digest = hashlib.sha256()
        while chunk := blob.read(1024**2):
            digest.update(chunk)
    if "sha256:" + digest.hexdigest() != descriptor.digest:
        raise ImageError(f"{what}: blob {descriptor.digest} has sha256:{digest.hexdigest()}: the image is corrupt "
                         "or was changed; fetch it again")


def _open_regular(path: Path, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ImageError(f"{what}: cannot open {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageError(f"{what}: {path} is not a regular file")
    return fd


def _read_bounded(path: Path, limit: int, what: str) -> bytes:
    fd = _open_regular(path, what)
    with os.fdopen(fd, "rb") as source:
        data = source.read(limit + 1)
    if len(data) > limit:
        raise ImageError(f"{what}: larger than {limit} bytes")
    return data


def _object(doc: object, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ImageError(f"{what}: not a JSON object")
    return doc


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
