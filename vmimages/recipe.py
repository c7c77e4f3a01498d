"""A template recipe: what goes into a template, and the digest that says when to rebuild it.

Recipes are read by vmimages.recipebook (the built-in ones beside this file, an operator's from the
service config's `recipes:` directory). A recipe with `image:` is an image template: the VM is the
`base` recipe's (kernel, packages, init, agent), and an OCI image's root filesystem is unpacked at
IMAGE_ROOT in its disk; the guest agent runs every command inside it (vmimages/guest/agent.py,
IMAGE_SPEC), so the image needs no Python and nothing of ours.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runner.errors import TemplateError
from vmimages.initramfs import GUEST_DIR
from vmimages.rootfs import AGENT_FILES

RECIPES_DIR = Path(__file__).parent / "recipes"
GUEST_FILES = {**AGENT_FILES, "init": GUEST_DIR / "init", "initramfs-init": GUEST_DIR / "initramfs-init"}
ADDED_LATER = ("kernel_modules", "disk_mib", "image")
KERNEL_CMDLINE = "console=ttyS0 quiet loglevel=3 panic=-1 i8042.noaux i8042.nokbd"


class RecipeError(TemplateError):
    pass


@dataclass(frozen=True)
class Size:
    """A size class to bake a recipe at (the service config's `sizes:`): the template is `<recipe>.<name>`."""

    name: str
    vcpus: int
    memory_mib: int
    disk_mib: int


@dataclass(frozen=True)
class Recipe:
    name: str
    suite: str = "bookworm"
    packages: tuple[str, ...] = ()
    kernel: str = "linux-image-amd64"
    memory_mib: int = 512
    vcpus: int = 1
    warmup: tuple[str, ...] = field(default_factory=tuple)
    # Module trees (paths under the kernel's lib/modules/<version>/, e.g. kernel/net/bridge) copied into
    # the root filesystem with their dependencies and indexed by depmod, so the guest's modprobe (and the
    # kernel's autoload) finds them: what a container engine needs beyond the initramfs' boot modules.
    kernel_modules: tuple[str, ...] = ()
    # Free space in the root filesystem for the job, MiB (0: rootfs.FREE_SPACE_MIB): a size class sets it.
    disk_mib: int = 0
    # An OCI image in skopeo's transport syntax (vmimages.oci.reference): jobs run in its root filesystem.
    image: str = ""

    @classmethod
    def load(cls, name: str, operator_dir: Path | None = None) -> Recipe:
        """The recipe `name`: built in, or an operator's in `operator_dir` (vmimages.recipebook)."""
        from vmimages.recipebook import find

        return find(name, operator_dir)

    def digest(self, kernel_package: str, accel: str, hypervisor_version: str, machine_args: list[str],
               image_digest: str = "") -> str:
        """Changes whenever anything that ends up in the template changes: for an image template, the
        manifest digest of the image it was built from (not its tag, which may move)."""
        h = hashlib.sha256()
        fields = asdict(self)
        # Fields added after templates existed count only when set: a recipe that does not use them
        # keeps the digest it had, so the hosts' baked `base` stays current.
        for name in ADDED_LATER:
            if not fields[name]:
                del fields[name]
        h.update(json.dumps(fields, sort_keys=True).encode())
        h.update(json.dumps([kernel_package, accel, hypervisor_version, KERNEL_CMDLINE, machine_args]).encode())
        if image_digest:
            h.update(b"image\0" + image_digest.encode())
        for name, source in GUEST_FILES.items():
            h.update(name.encode() + b"\0" + source.read_bytes())
        return h.hexdigest()[:20]

    def to_json(self) -> dict[str, object]:
        """The recipe as the template's manifest records it."""
        return asdict(self) | {"packages": list(self.packages), "warmup": list(self.warmup),
                               "kernel_modules": list(self.kernel_modules)}
