"""`template build`: kernel, initramfs, rootfs, then one baked snapshot per variant.

Each step is cached where it is slow (the kernel download, debootstrap), and the whole template
is keyed by a digest of its recipe, so a second build with nothing changed is a no-op.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from runner.errors import TemplateError
from runner.vm import accel as accel_mod
from runner.vm.hypervisor import Launch, MachineConfig
from runner.vm.qemu import QemuHypervisor, bake_backends, device_args
from runner.vm.statedir import StateDir
from runner.vm.templates import VARIANTS, Template, TemplateStore, sized
from vmimages import bake, initramfs, kernel, rootfs
from vmimages.recipe import KERNEL_CMDLINE, Recipe, Size

if TYPE_CHECKING:
    from vmimages import imageroot


class Progress:
    """One line per step with its duration: a build takes minutes and should say where it is."""

    def __init__(self, total: int, out: TextIO = sys.stderr) -> None:
        self.total = total
        self.step = 0
        self.out = out
        self.started = time.monotonic()

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        self.step += 1
        t = time.monotonic()
        print(f"[{self.step}/{self.total}] {what} ...", file=self.out, flush=True)
        yield
        print(f"[{self.step}/{self.total}] {what}: done in {time.monotonic() - t:.1f} s", file=self.out, flush=True)

    def say(self, text: str) -> None:
        print(f"      {text}", file=self.out, flush=True)


def _machine_shape(recipe: Recipe, accel: str) -> list[str]:
    """The device model with placeholder paths: part of the digest, so a device change rebuilds."""
    placeholder = Path("/x")
    config = MachineConfig(placeholder, placeholder, KERNEL_CMDLINE, recipe.memory_mib, recipe.vcpus, True, accel)
    return device_args(config, bake_backends(config, placeholder, Launch(placeholder, placeholder, "qcow2")), bake=True)


@contextmanager
def _staging(path: Path) -> Iterator[Path]:
    """The build's scratch directory, root's and 0700 (an image's tree, set-id files and all, is unpacked in
    it); removed when the build fails, so a refused image leaves nothing of its own behind."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, mode=0o700)
    path.chmod(0o700)
    try:
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(recipe: Recipe, state: StateDir, force: bool = False, size: Size | None = None,
          images: imageroot.ImageSource | None = None, refresh: bool = False) -> Template:
    """Build `recipe` (at `size`) into the state's template store. An image recipe's image is fetched
    through `images` by the digest its last build pinned, or by its reference when `refresh` (or new)."""
    state.ensure()
    name = recipe.name
    if size is not None:
        recipe = replace(recipe, vcpus=size.vcpus, memory_mib=size.memory_mib, disk_mib=size.disk_mib)
        name = sized(recipe.name, size.name)
    store = TemplateStore(state.templates)
    hv = QemuHypervisor()
    progress = Progress(total=5 + len(VARIANTS) + 2 * bool(recipe.image))
    # the stack holds the staging directory and the fetched image's (an image recipe) until the build ends
    with _locked(state.templates / f".{name}.lock"), ExitStack() as stack:
        with progress(f"resolve and fetch the guest kernel ({recipe.kernel})"):
            package = kernel.resolve_package(recipe.kernel)
            guest_kernel = kernel.fetch(package, state.cache)
            progress.say(package)
        staging = stack.enter_context(_staging(state.cache / "staging" / name))
        with progress("build the initramfs (busybox + virtio/ext4 modules)"):
            initrd = initramfs.build(guest_kernel, staging / "initrd.img", staging / "initramfs")
        with progress("choose the accelerator"):
            chosen = accel_mod.detect(hv.binary, guest_kernel.vmlinuz, initrd)
            progress.say(f"{chosen.name}: {chosen.reason}")
        boot_image, boot_kind = guest_kernel.bootable(staging)
        fetched = None
        if recipe.image:
            from vmimages import imageroot  # skopeo and the layer applier: image templates only
            source = images or imageroot.ImageSource()
            ref = imageroot.pinned_ref(recipe.image, _previous_image(store, name), refresh)
            with progress(f"fetch the image {ref} and verify its blobs"):
                fetched = stack.enter_context(imageroot.fetched_image(name, ref, source, progress.say))
                progress.say(f"manifest {fetched.manifest_digest}, {len(fetched.layers)} layer(s)")
        # How the kernel boots is part of the machine: a snapshot's memory holds the kernel it booted.
        digest = recipe.digest(package, chosen.name, hv.version(),
                               [*_machine_shape(recipe, chosen.name), f"kernel-boot={boot_kind}"],
                               image_digest=fetched.manifest_digest if fetched else "")
        if store.has(name, digest) and not force:
            shutil.rmtree(staging)
            progress.say(f"template {name} {digest} is up to date")
            store.publish(name, digest)
            return store.get(name)
        unpacked = None
        if fetched is not None:
            with progress("unpack the image's layers (as untrusted input: vmimages/oci/layers.py)"):
                unpacked = imageroot.unpack(fetched, staging, source)
                imageroot.check_budget(store, name, unpacked.bytes, len(VARIANTS), source.disk_budget)
                progress.say(f"image unpacked: {unpacked.files} files, {unpacked.bytes / 2**20:.0f} MiB")
        with progress(f"debootstrap {recipe.suite} (cached after the first time)"):
            base = rootfs.debootstrap(recipe.suite, recipe.packages, state.cache)
        with progress("customise the root filesystem and make its ext4 image"):
            tree = rootfs.customise(base, staging / "rootfs")
            rootfs.install_modules(guest_kernel, recipe.kernel_modules, tree)
            image_entry = None
            if fetched is not None and unpacked is not None:
                imageroot.install(unpacked, fetched, tree)
                image_entry = imageroot.record(recipe.image, ref, fetched, unpacked)
            image = rootfs.make_image(tree, staging / "disk.img", recipe.disk_mib or rootfs.FREE_SPACE_MIB)
            shutil.rmtree(tree)
        out = store.dir_for(name, digest)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copy2(boot_image, out / "vmlinuz")  # the image QEMU boots (the PVH ELF, else the bzImage)
        progress.say(f"kernel boots by {boot_kind}")
        shutil.copy2(initrd, out / "initrd.img")
        agent_ops: frozenset[str] = frozenset()
        for variant, network in VARIANTS.items():
            with progress(f"bake the '{variant}' snapshot (cold boot, warm up, quiesce, snapshot)"):
                config = MachineConfig(
                    kernel=out / "vmlinuz",
                    initrd=out / "initrd.img",
                    cmdline=KERNEL_CMDLINE,
                    memory_mib=recipe.memory_mib,
                    vcpus=recipe.vcpus,
                    network=network,
                    accel=chosen.name,
                )
                agent_ops = bake.bake(hv, config, image, out / variant, recipe.warmup, progress.say,
                                      final_sync=not recipe.image)
        manifest = {
            "name": name,
            "digest": digest,
            "recipe": recipe.to_json(),
            "source": "image" if image_entry else "recipe",
            "kernel_package": package,
            "accel": chosen.name,
            "accel_reason": chosen.reason,
            "hypervisor": hv.name,
            "hypervisor_version": hv.version(),
            "cmdline": KERNEL_CMDLINE,
            "kernel_boot": boot_kind,
            "agent_ops": sorted(agent_ops),  # what the baked agent answered: the host checks it (templates.stale_agent)
            "memory_mib": recipe.memory_mib,
            "vcpus": recipe.vcpus,
            "created": time.time(),
        }
        if image_entry is not None:
            manifest["image"] = image_entry
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(staging)
        store.publish(name, digest)
        print(f"template {name} {digest} ready ({time.monotonic() - progress.started:.0f} s)", file=sys.stderr)
        return store.get(name)


def _previous_image(store: TemplateStore, name: str) -> dict[str, object] | None:
    """The `image` entry of the template's current build, if it has one (its pinned digest)."""
    try:
        entry = store.get(name).manifest.get("image")
    except TemplateError:
        return None
    return entry if isinstance(entry, dict) else None
