"""The guest kernel: Debian's own, downloaded as a package and unpacked, never installed.

Debian's kernel builds virtio and ext4 as modules, so we also work out which modules the
initramfs must load, in dependency order, with the host's modprobe over the unpacked tree.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from vmimages.run import BuildError, run

# Everything the template's devices need, by the name modprobe knows them by.
GUEST_MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "virtio_net", "virtio-rng", "ext4",
                 "virtio_scsi", "sr_mod", "overlay")  # the checkout's CD-ROM (runner/vm/checkoutdisk.py)


@dataclass(frozen=True)
class Kernel:
    version: str  # e.g. 6.1.0-57-amd64
    package: str  # e.g. linux-image-6.1.0-57-amd64
    tree: Path  # the unpacked package

    @property
    def vmlinuz(self) -> Path:
        return self.tree / "boot" / f"vmlinuz-{self.version}"

    def module_files(self) -> list[Path]:
        """Module files to load for GUEST_MODULES, dependencies first, each once."""
        ordered: list[Path] = []
        for name in GUEST_MODULES:
            out = run(["modprobe", "-d", str(self.tree), "-S", self.version, "--show-depends", name])
            for line in out.splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "insmod":
                    path = Path(parts[1]).resolve()
                    if path not in ordered:
                        ordered.append(path)
        return ordered


def resolve_package(meta: str = "linux-image-amd64") -> str:
    """The concrete kernel package the meta package points at today (part of the recipe hash)."""
    out = run(["apt-cache", "depends", meta])
    match = re.search(r"Depends:\s*(linux-image-\S+)", out)
    if not match:
        raise BuildError(f"cannot resolve {meta} with apt-cache: run 'apt-get update' first")
    return match.group(1)


def fetch(package: str, cache: Path) -> Kernel:
    """Download and unpack `package` into the cache (once)."""
    version = package.removeprefix("linux-image-")
    tree = cache / "kernel" / version
    if not (tree / "boot" / f"vmlinuz-{version}").exists():
        work = cache / "kernel" / f"{version}.partial"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        run(["apt-get", "download", package], cwd=work)
        (deb,) = work.glob("*.deb")
        run(["dpkg", "-x", str(deb), str(work / "tree")])
        run(["depmod", "-b", str(work / "tree"), version])
        shutil.rmtree(tree, ignore_errors=True)
        (work / "tree").rename(tree)
        shutil.rmtree(work)
    return Kernel(version=version, package=package, tree=tree)
