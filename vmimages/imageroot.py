"""An image template's image: fetched by its pinned digest, unpacked into the template's root disk.

The image's root filesystem goes to IMAGE_ROOT inside the VM's own root filesystem, and IMAGE_SPEC
tells the guest agent to run every command in it with the image config's Env, WorkingDir and User
(vmimages/guest/agent.py). One disk, not two: the restore, checkout, warm-base and snapshot paths
stay the ones every template uses, and each job's writes to the image go to its own throwaway
overlay like all its other writes.

A tag is resolved once: the manifest digest the first build fetched is recorded in the template's
manifest (`image.pinned`), and later builds fetch that digest until `template build --refresh`.

The unpacked tree is a stranger's (set-id files, any owner): it is made under the build's staging
directory, which is root's and 0700, so no other host user can reach it, and it leaves the host only
inside the ext4 image mkfs writes.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.errors import ImageError
from runner.vm.templates import TemplateStore
from vmimages.oci import FetchedImage, ImageLimits, ImageRef, apply_layers, fetch

IMAGE_ROOT = "image"  # /image in the guest
IMAGE_SPEC = Path("etc/microvm-check/image.json")  # the agent's vmimages/guest/agent.py IMAGE_SPEC
FETCH_PARENT, FETCH_PREFIX = "/var/tmp", "mvc-image-"


@dataclass(frozen=True)
class ImageSource:
    """How this host reaches registries: skopeo's own files (mirrors, insecure registries, credentials)."""

    registries_conf: Path | None = None
    authfile: Path | None = None
    limits: ImageLimits = ImageLimits()
    disk_budget: int | None = None  # bytes all image templates may take together (the config's images.disk_budget)


def pinned_ref(image: str, previous: dict[str, Any] | None, refresh: bool) -> ImageRef:
    """What to fetch: the digest an earlier build of the same reference recorded, unless refreshing."""
    ref = ImageRef.parse(image)
    if previous and previous.get("ref") == image and previous.get("pinned") and not refresh:
        return ImageRef.parse(str(previous["pinned"]))
    return ref


@contextmanager
def fetched_image(name: str, ref: ImageRef, source: ImageSource, say: Callable[[str], None]) -> Iterator[FetchedImage]:
    """The image of template `name` fetched and verified, in a directory of its own that is removed after
    (FETCH_PREFIX + name): one uid 65534 can enter (skopeo runs as that uid, vmimages/oci/confine.py), unlike
    the build's 0700 staging directory."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{FETCH_PREFIX}{name}-", dir=FETCH_PARENT))
    try:
        workdir.chmod(0o711)
        yield fetch(ref, workdir, source.limits, authfile=source.authfile, registries_conf=source.registries_conf,
                    say=say)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True)
class Unpacked:
    """An image's root filesystem applied from its layers, waiting in the build's 0700 staging directory."""

    root: Path
    files: int
    bytes: int


def unpack(fetched: FetchedImage, staging: Path, source: ImageSource) -> Unpacked:
    """Apply the image's layers into `staging`: first, before the root filesystem is made, so a hostile
    image is refused before any other work is spent on it."""
    root = staging / "image-root"
    root.mkdir(mode=0o755)
    stats = apply_layers(fetched.layers, root, source.limits)
    return Unpacked(root, stats.files, stats.bytes)


def install(unpacked: Unpacked, fetched: FetchedImage, tree: Path) -> None:
    """Move the unpacked image to IMAGE_ROOT in the VM's root filesystem `tree` (the same staging directory,
    so a rename) and write IMAGE_SPEC, which turns the agent's image mode on."""
    unpacked.root.rename(tree / IMAGE_ROOT)
    spec = tree / IMAGE_SPEC
    spec.parent.mkdir(parents=True, exist_ok=True)
    config = fetched.config
    spec.write_text(json.dumps({"root": f"/{IMAGE_ROOT}", "env": list(config.env), "workdir": config.workdir,
                                "user": config.user}, indent=2) + "\n")


def check_budget(store: TemplateStore, name: str, unpacked_bytes: int, copies: int, budget: int | None) -> None:
    """Refuse a build whose template would take the image templates past `budget`: each of its `copies`
    (snapshot variants) holds a disk with the image, and the other image templates keep what they take now
    (a rebuild of `name` replaces its own, so that is not counted)."""
    if budget is None:
        return
    used = sum(t.size_bytes() for t in store.list() if t.manifest.get("source") == "image" and t.name != name)
    needed = unpacked_bytes * copies
    if used + needed > budget:
        raise ImageError(f"the image templates would take {_gib(used + needed)} ({_gib(used)} now, about "
                         f"{_gib(needed)} for {name}), more than images.disk_budget ({_gib(budget)}): remove one "
                         "with microvm-check template rm NAME, or raise the budget in the service config")


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def record(image: str, ref: ImageRef, fetched: FetchedImage, unpacked: Unpacked) -> dict[str, Any]:
    """The template manifest's `image` entry: what the recipe named, what was fetched, what jobs run with."""
    pinned = ref.pinned(fetched.source_digest) if ref.transport == "docker" else ref  # what the registry calls it
    return {"ref": image, "pinned": str(pinned), "manifest_digest": fetched.manifest_digest,
            "config": fetched.config.to_json(), "files": unpacked.files, "bytes": unpacked.bytes}
