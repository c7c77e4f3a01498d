"""The template boots the kernel's uncompressed ELF by its PVH entry (vmimages.kernel.pvh_elf) only
when the bzImage really holds one: an XZ payload that is a 64-bit ELF with Xen's PHYS32_ENTRY note."""

from __future__ import annotations

import lzma
import struct
from pathlib import Path

import pytest

from vmimages.kernel import XEN_ELFNOTE_PHYS32_ENTRY, Kernel, pvh_elf


def elf_with_note(name: bytes, kind: int) -> bytes:
    """A minimal ELF64 image: one PT_NOTE program header over one note."""
    padded = name + b"\0" * ((4 - len(name) % 4) % 4)
    note = struct.pack("<III", len(name), 4, kind) + padded + struct.pack("<I", 0x1000000)
    phoff, phentsize = 64, 56
    header = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, 0, phoff, 0, 0, 64,
                                                              phentsize, 1, 0, 0, 0)
    note_at = phoff + phentsize
    phdr = struct.pack("<IIQQQQQQ", 4, 4, note_at, 0, 0, len(note), len(note), 4)
    return header + phdr + note


def bzimage(payload: bytes) -> bytes:
    return b"MZ set-up code " * 100 + lzma.compress(payload, format=lzma.FORMAT_XZ) + b"\0trailer"


def test_the_elf_with_a_pvh_note_comes_out_whole() -> None:
    elf = elf_with_note(b"Xen", XEN_ELFNOTE_PHYS32_ENTRY)
    assert pvh_elf(bzimage(elf)) == elf


@pytest.mark.parametrize("name,kind", [(b"Xen", 5), (b"GNU", XEN_ELFNOTE_PHYS32_ENTRY)])
def test_an_elf_without_the_pvh_note_is_not_used(name: bytes, kind: int) -> None:
    assert pvh_elf(bzimage(elf_with_note(name, kind))) is None


def test_no_xz_payload_or_not_an_elf_falls_back() -> None:
    assert pvh_elf(b"MZ" + b"\0" * 4096) is None
    assert pvh_elf(bzimage(b"not an ELF at all" * 10)) is None
    assert pvh_elf(b"junk\xfd7zXZ\x00truncated") is None


def test_bootable_writes_the_elf_or_keeps_the_bzimage(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "boot").mkdir(parents=True)
    kernel = Kernel(version="6.1.0-0-amd64", package="linux-image-6.1.0-0-amd64", tree=tree)
    elf = elf_with_note(b"Xen", XEN_ELFNOTE_PHYS32_ENTRY)
    kernel.vmlinuz.write_bytes(bzimage(elf))
    image, how = kernel.bootable(tmp_path)
    assert (how, image.read_bytes()) == ("pvh", elf)
    kernel.vmlinuz.write_bytes(bzimage(b"no elf"))
    assert kernel.bootable(tmp_path) == (kernel.vmlinuz, "bzimage")
