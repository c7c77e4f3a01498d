"""Baked templates on disk, and how the engine finds the one to restore.

    <root>/templates/<name>/current              digest of the template in use
    <root>/templates/<name>/<digest>/manifest.json
    <root>/templates/<name>/<digest>/{vmlinuz,initrd.img}
    <root>/templates/<name>/<digest>/<variant>/{disk.img,mem.ram,state.bin}

A variant is the same template with (`net`) or without (`nonet`) a network card: a restore must
have exactly the template's devices, and a VM without network must not even have a NIC.
Everything under a digest is read-only once baked; a new recipe gets a new digest.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from runner.vm.hypervisor import MachineConfig, Snapshot

VARIANTS = {"net": True, "nonet": False}


class TemplateNotFound(LookupError):
    pass


@dataclass(frozen=True)
class Template:
    name: str
    digest: str
    path: Path
    manifest: dict

    def snapshot(self, network: bool) -> Snapshot:
        variant = "net" if network else "nonet"
        m = self.manifest
        config = MachineConfig(
            kernel=self.path / "vmlinuz",
            initrd=self.path / "initrd.img",
            cmdline=m["cmdline"],
            memory_mib=m["memory_mib"],
            vcpus=m["vcpus"],
            network=network,
            accel=m["accel"],
        )
        vdir = self.path / variant
        return Snapshot(config=config, mem_file=vdir / "mem.ram", state_file=vdir / "state.bin", disk=vdir / "disk.img")

    def size_bytes(self) -> int:
        return sum(p.stat().st_blocks * 512 for p in self.path.rglob("*") if p.is_file())


class TemplateStore:
    def __init__(self, root: Path) -> None:
        self.root = root  # <state>/templates

    def dir_for(self, name: str, digest: str) -> Path:
        return self.root / name / digest

    def get(self, name: str) -> Template:
        current = self.root / name / "current"
        if not current.exists():
            raise TemplateNotFound(
                f"no template named {name!r} in {self.root}: build it with 'microvm-check template build {name}'"
            )
        digest = current.read_text().strip()
        path = self.dir_for(name, digest)
        manifest = json.loads((path / "manifest.json").read_text())
        return Template(name=name, digest=digest, path=path, manifest=manifest)

    def has(self, name: str, digest: str) -> bool:
        return (self.dir_for(name, digest) / "manifest.json").exists()

    def publish(self, name: str, digest: str) -> None:
        """Make `digest` the current template of `name` (atomically) and drop the older ones."""
        tmp = self.root / name / "current.tmp"
        tmp.write_text(digest + "\n")
        tmp.replace(self.root / name / "current")
        for old in (self.root / name).iterdir():
            if old.is_dir() and old.name != digest:
                shutil.rmtree(old)

    def list(self) -> list[Template]:
        found = []
        if self.root.exists():
            for entry in sorted(self.root.iterdir()):
                try:
                    found.append(self.get(entry.name))
                except (TemplateNotFound, OSError, ValueError):
                    continue
        return found

    def remove(self, name: str) -> None:
        path = self.root / name
        if not path.exists():
            raise TemplateNotFound(f"no template named {name!r} in {self.root}")
        shutil.rmtree(path)
