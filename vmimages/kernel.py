"""The guest kernel: Debian's own, downloaded as a package and unpacked, never installed.

Debian's kernel builds virtio and ext4 as modules, so we also work out which modules the
initramfs must load, in dependency order, with the host's modprobe over the unpacked tree.

The template boots the kernel uncompressed, by its PVH entry point, when it has one (Debian's has,
CONFIG_PVH=y): QEMU then loads the ELF image straight into guest memory, and the guest skips the
real-mode set-up and the XZ decompressor. Under software emulation that decompression was 4-5 s of
a 12-15 s cold boot (measured, docs/platform.md); the bzImage remains the fallback.
"""

from __future__ import annotations

import lzma
import re
import shutil
import struct
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

    def bootable(self, work: Path) -> tuple[Path, str]:
        """The image QEMU should boot and how: ("pvh") the uncompressed ELF, written to `work`, when
        the kernel has a PVH entry, else ("bzimage") Debian's compressed kernel as it is."""
        elf = pvh_elf(self.vmlinuz.read_bytes())
        if elf is None:
            return self.vmlinuz, "bzimage"
        out = work / "vmlinux"
        out.write_bytes(elf)
        return out, "pvh"

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

    @property
    def modules_dir(self) -> Path:
        return self.tree / "lib" / "modules" / self.version

    def module_closure(self, trees: tuple[str, ...]) -> list[str]:
        """The module files (relative to `modules_dir`) under `trees` and every module they depend on,
        from the kernel's own modules.dep: what a root filesystem needs for modprobe to load them."""
        deps: dict[str, list[str]] = {}
        for line in (self.modules_dir / "modules.dep").read_text().splitlines():
            module, _, needs = line.partition(":")
            deps[module] = needs.split()
        wanted: list[str] = []
        for tree in trees:
            prefix = tree.rstrip("/")
            found = [m for m in deps if m == prefix or m.startswith(prefix + "/")]
            if not found:
                raise BuildError(f"recipe kernel_modules: nothing under {tree!r} in {self.package}")
            wanted += found
        closure: list[str] = []
        while wanted:
            module = wanted.pop()
            if module not in closure:
                closure.append(module)
                wanted += deps[module]
        return sorted(closure)


XZ_MAGIC = b"\xfd7zXZ\x00"
XEN_ELFNOTE_PHYS32_ENTRY = 18  # the PVH entry point note QEMU looks for (include/xen/interface/elfnote.h)


def pvh_elf(bzimage: bytes) -> bytes | None:
    """The ELF kernel inside an XZ-compressed bzImage, if it has a PVH entry note; else None."""
    start = bzimage.find(XZ_MAGIC)
    if start < 0:
        return None
    try:
        elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(bzimage[start:])
    except lzma.LZMAError:
        return None
    return elf if _has_pvh_note(elf) else None


def _has_pvh_note(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF image has a Xen PHYS32_ENTRY note in a PT_NOTE segment."""
    if elf[:6] != b"\x7fELF\x02\x01":
        return False
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", elf, phoff + i * phentsize)
        if p_type != 4:  # PT_NOTE
            continue
        at, end = p_offset, p_offset + p_filesz
        while at + 12 <= end:
            namesz, descsz, kind = struct.unpack_from("<III", elf, at)
            name = elf[at + 12:at + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and kind == XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            at += 12 + (namesz + 3) // 4 * 4 + (descsz + 3) // 4 * 4
    return False


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
