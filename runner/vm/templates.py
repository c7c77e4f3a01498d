"""Baked templates on disk, and how the engine finds the one to restore.

    <root>/templates/<name>/current              digest of the template in use
    <root>/templates/<name>/<digest>/manifest.json
    <root>/templates/<name>/<digest>/{vmlinuz,initrd.img}
    <root>/templates/<name>/<digest>/<variant>/{disk.img,mem.ram,state.bin}

A variant is the same template with (`net`) or without (`nonet`) a network card: a restore must
have exactly the template's devices, and a VM without network must not even have a NIC.
Everything under a digest is read-only once baked; a new recipe gets a new digest.

A template can also be made from a running VM (`Engine.snapshot`: a repository's warm base, or
`Sandbox.snapshot`). Its manifest names its `parent` and the one variant it has; its kernel
and initrd are its parent's (`TemplateStore.write_derived`; `owner` reads the lineage back).
`<root>/templates/<name>/last-used` is touched at each restore, so the derived templates can be
held to a disk budget, least recently used first (`evict`).

Several processes share one store (`serve` beside `microvm-check run`, two services with state
directories of their own), so two kinds of flock keep one from deleting what another uses:

- a digest directory is shared-locked (`hold`) by every process whose VMs run from it (Engine) and by
  the process building it (`begin` to `publish` or `abandon`); it is removed only by a process that
  gets it exclusively (`collect`), so never while held, and a holder that locked a directory removed
  meanwhile sees it gone (`TemplateNotFound`);
- `<root>/templates/.locks/<name>.lock` is taken by whoever changes which digests of `name` exist or
  which is current (begin, publish, collect, remove), for the moment of the change only, so a
  check and the removal it allows are one step.

A digest no longer current is removed by the publish that replaced it, or, if it was held then, by
its last holder's `collect` once the holder lets go.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.errors import TemplateError
from runner.vm import guestwire
from runner.vm.hypervisor import MachineConfig, Snapshot

VARIANTS = {"net": True, "nonet": False}
LAST_USED = "last-used"
CURRENT = "current"
LOCKS = ".locks"  # not a NAME: never listed as a template
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,199}")


def sized(template: str, size: str) -> str:
    """The name of `template` baked at the size class `size` (vmimages: template build NAME --size SIZE)."""
    return f"{template}.{size}"


def build_command(name: str, config: str | Path | None = None) -> str:
    """The command that (re)builds template `name` from its recipe: `<recipe>.<size>` is baked at a size class
    of a service config's `sizes:`; `config` (a path) is the service config whose state directory holds it."""
    recipe, _, size = name.partition(".")
    option = f" --config {config}" if config is not None else ""
    if size and "--" not in name:  # `<recipe>.<size>`, not a warm base of a dotted repository
        return f"microvm-check template build {recipe} --size {size} --config {config or '<the service config>'}"
    return f"microvm-check template build {name}{option}"


class TemplateNotFound(TemplateError):
    """No such template on this host; the message says how to build it."""


@dataclass(frozen=True)
class Template:
    name: str
    digest: str
    path: Path
    # manifest.json, written by this host (vmimages.build, Engine.snapshot): open-ended, since a
    # derived template carries its maker's extra members too.
    manifest: dict[str, Any]

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(self.manifest.get("variants", VARIANTS))

    @property
    def agent_ops(self) -> frozenset[str]:
        """The operations its guest agent answered to at bake time (a derived template runs its parent's
        agent, and inherits the record); empty for a template baked before they were recorded."""
        ops = self.manifest.get("agent_ops")
        return frozenset(op for op in ops if isinstance(op, str)) if isinstance(ops, list) else frozenset()

    @property
    def derived(self) -> bool:
        """Made from a running VM (not baked from a recipe)."""
        return "parent" in self.manifest

    @property
    def sandbox(self) -> bool:
        """A sandbox's snapshot (Engine.snapshot's extra member "sandbox"): it lives only as long as its
        sandboxes (runner/service/jobs/sandboxes.py), never in the warm bases' budget, never past a restart."""
        return "sandbox" in self.manifest

    @property
    def made_in(self) -> Path | None:
        """The state directory of the engine that made it from a running VM (Engine.snapshot); None for a
        baked template, or one made before this was recorded."""
        made_in = self.manifest.get("made_in")
        return Path(made_in) if isinstance(made_in, str) else None

    def snapshot(self, network: bool) -> Snapshot:
        variant = "net" if network else "nonet"
        if variant not in self.variants:
            have = "with" if network is False else "without"
            raise TemplateNotFound(f"template {self.name!r} was snapshotted from a VM {have} a network card: create "
                                f"the sandbox with network={not network}, or snapshot one with network={network}")
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

    @staticmethod
    def variant_files(source: Snapshot, variant_dir: Path) -> Snapshot:
        """The files of a new variant in `variant_dir`, for a VM restored from `source` (same machine)."""
        return Snapshot(config=source.config, mem_file=variant_dir / "mem.ram", state_file=variant_dir / "state.bin",
                        disk=variant_dir / "disk.img")

    def size_bytes(self) -> int:
        return sum(p.stat().st_blocks * 512 for p in self.path.rglob("*") if p.is_file())


@dataclass
class DigestHold:
    """A shared flock on one digest's directory: while any process has one, no store removes it."""

    path: Path  # <root>/<name>/<digest>
    _fd: int

    def close(self) -> None:
        """Let go (idempotent); the caller runs `TemplateStore.collect` if the digest may now go."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class TemplateStore:
    def __init__(self, root: Path) -> None:
        self.root = root  # <state>/templates
        self._builds: dict[Path, DigestHold] = {}  # this store's builds under way (begin to publish/abandon)
        self._builds_lock = threading.Lock()

    def dir_for(self, name: str, digest: str) -> Path:
        return self.root / name / digest

    def get(self, name: str) -> Template:
        current = self.root / name / CURRENT
        if not current.exists():
            raise TemplateNotFound(f"no template named {name!r} in {self.root}: build it with '{build_command(name)}'")
        digest = current.read_text().strip()
        path = self.dir_for(name, digest)
        manifest = json.loads((path / "manifest.json").read_text())
        return Template(name=name, digest=digest, path=path, manifest=manifest)

    def last_used(self, name: str) -> float:
        """When a VM was last restored from `name` (its creation time if never)."""
        try:
            return (self.root / name / LAST_USED).stat().st_mtime
        except FileNotFoundError:
            return (self.root / name / CURRENT).stat().st_mtime

    def touch(self, name: str) -> None:
        """Record a restore from `name`, for least-recently-used eviction."""
        path = self.root / name / LAST_USED
        try:
            os.utime(path)
        except FileNotFoundError:
            path.touch()

    def begin(self, name: str, digest: str) -> Path:
        """An empty directory for a new build of `name` (a `NAME`), held until `publish` or `abandon`; a
        partial one of an earlier try that died is dropped. The same digest being built, or restored from,
        by another process is refused: it is not this build's to delete."""
        path = self.dir_for(name, digest)
        with self._name_locked(name):
            if path.exists() and not _remove_unheld(path):
                raise TemplateError(f"template {name!r} {digest} is being built, or VMs run from it, in another "
                                    "process sharing this template store: wait for it, or make it under another name")
            path.mkdir(parents=True)
            hold = self.hold(path)
        with self._builds_lock:
            self._builds[path] = hold
        return path

    def abandon(self, name: str, digest: str) -> None:
        """Drop a build begun here that will not be published."""
        path = self.dir_for(name, digest)
        with self._name_locked(name):
            shutil.rmtree(path, ignore_errors=True)
            self._end_build(path)
            _collect(self.root / name)  # a first build's name goes with it

    def hold(self, path: Path) -> DigestHold:
        """Hold the digest directory `path` (a `Template.path`) until the hold is closed; TemplateNotFound
        when another process removed it (then `get` the name again: it has a newer current)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TemplateNotFound(f"template {path.parent.name!r} {path.name} was removed by another process") from None
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a removal under way
        if os.fstat(fd).st_nlink == 0:  # removed while we waited
            os.close(fd)
            raise TemplateNotFound(f"template {path.parent.name!r} {path.name} was removed by another process")
        return DigestHold(path, fd)

    def collect(self, name: str) -> list[str]:
        """Remove the digests of `name` that are not current and that no process holds (and `name` itself
        once removed and empty); the digests removed."""
        with self._name_locked(name):
            return _collect(self.root / name)

    def evict(self, budget_bytes: int, keep: frozenset[str] = frozenset(),
              before_remove: Callable[[str], None] | None = None) -> list[str]:
        """Remove derived templates, least recently used first, until they fit in `budget_bytes`
        together; `keep` (e.g. the one just built) and sandboxes' snapshots (which their live sandboxes
        may restore from; bounded by the sandboxes' own counts) are never removed nor counted. `before_remove(name)` runs
        first for each (the engine ends its spare VMs). Returns the names removed."""
        derived = [t for t in self.list() if t.derived and not t.sandbox]
        sizes = {t.name: t.size_bytes() for t in derived}
        total = sum(sizes.values())
        removed = []
        for template in sorted(derived, key=lambda t: self.last_used(t.name)):
            if total <= budget_bytes:
                break
            if template.name in keep:
                continue
            if before_remove is not None:
                before_remove(template.name)
            self.remove(template.name)
            total -= sizes[template.name]
            removed.append(template.name)
        return removed

    def owner(self, snapshot: Snapshot) -> Template:
        """The template a variant's files belong to (<root>/<name>/<digest>/<variant>/), as it was baked,
        also while a newer build of the name is current: a VM's lineage is what it was restored from."""
        digest_dir = snapshot.state_file.parent.parent
        return Template(name=digest_dir.parent.name, digest=digest_dir.name, path=digest_dir,
                        manifest=json.loads((digest_dir / "manifest.json").read_text()))

    def write_derived(self, path: Path, parent: Template, variant: str, extra: dict[str, object]) -> None:
        """The manifest of a template made from a VM restored from `parent`, in `path` (from `begin`): the
        parent's (machine, accelerator, hypervisor version) with this template's own name, digest, one
        variant and lineage (`parent`, and `origin`: the built template at the root of a chain, as a VM
        resumed from a hibernate that was itself resumed has); its kernel and initrd are the parent's, linked."""
        for file in ("vmlinuz", "initrd.img"):
            try:
                os.link(parent.path / file, path / file)
            except OSError:
                shutil.copy2(parent.path / file, path / file)
        inherited = {key: value for key, value in parent.manifest.items() if key != "pooled"}  # the maker's to say
        lineage = {"name": parent.name, "digest": parent.digest}
        manifest = {**inherited, **extra, "name": path.parent.name, "digest": path.name, "variants": [variant],
                    "parent": lineage, "origin": parent.manifest.get("origin", lineage), "created": time.time()}
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    def has(self, name: str, digest: str) -> bool:
        return (self.dir_for(name, digest) / "manifest.json").exists()

    def publish(self, name: str, digest: str) -> None:
        """Make `digest` the current template of `name` (atomically) and drop the older ones no process
        holds (a held one goes when its last holder lets go: `collect`)."""
        with self._name_locked(name):
            tmp = self.root / name / f".{CURRENT}.{uuid.uuid4().hex}.tmp"
            tmp.write_text(digest + "\n")
            tmp.replace(self.root / name / CURRENT)
            (self.root / name / LAST_USED).touch()
            self._end_build(self.dir_for(name, digest))
            _collect(self.root / name)

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
        """Remove `name`: no VM restores from it from now on; its files go now, or, for a digest another
        process's VMs still run from, when that process lets go of it (`collect`)."""
        with self._name_locked(name):
            path = self.root / name
            if not path.exists():
                raise TemplateNotFound(f"no template named {name!r} in {self.root}")
            (path / CURRENT).unlink(missing_ok=True)
            _collect(self.root / name)

    def _end_build(self, path: Path) -> None:
        with self._builds_lock:
            hold = self._builds.pop(path, None)
        if hold is not None:
            hold.close()

    @contextmanager
    def _name_locked(self, name: str) -> Iterator[None]:
        """Hold `name`'s lock (every process sharing the store, every thread) for one change of its digests.
        The lock file goes with the name (removed while locked; a waiter that then gets the removed file's
        lock takes the new one instead), so names that come and go (snapshots) leave none behind."""
        lock = self.root / LOCKS / f"{name}.lock"
        lock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        while True:
            with open(lock, "w") as held:
                fcntl.flock(held, fcntl.LOCK_EX)
                if not _is_at(held.fileno(), lock):
                    continue
                try:
                    yield
                finally:
                    if not (self.root / name).exists():
                        lock.unlink()
                return


def _collect(path: Path) -> list[str]:
    """`TemplateStore.collect` of the name directory `path`, under the name's lock."""
    if not path.is_dir():
        return []
    try:
        current: str | None = (path / CURRENT).read_text().strip()
    except FileNotFoundError:
        current = None
    digests = [entry for entry in path.iterdir() if entry.is_dir()]
    removed = [entry.name for entry in digests if entry.name != current and _remove_unheld(entry)]
    if current is None and len(removed) == len(digests):
        shutil.rmtree(path)  # removed, and nothing of it held any more: its last-used goes too
    return removed


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the one at `path` (not removed nor replaced)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _remove_unheld(path: Path) -> bool:
    """Remove the digest directory `path` unless a process holds it; whether it was removed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        shutil.rmtree(path)  # locked: a holder that opened it meanwhile waits, then finds it gone
        return True
    finally:
        os.close(fd)


def stale_agent(template: Template, missing: frozenset[str] | None = None,
                config: str | Path | None = None) -> str | None:
    """Why this host cannot use `template` (its guest agent lacks operations the host sends: `missing`, by
    default those of guestwire.OPS its manifest does not record), with the command that fixes it (for the
    service config `config`, a path, when given); None when nothing is missing. A derived template's fix
    is its parent's rebuild: it runs its parent's agent."""
    lacking = sorted(guestwire.OPS - template.agent_ops if missing is None else missing)
    if not lacking:
        return None
    what = f"template {template.name!r} ({template.digest}) was baked with a guest agent older than this host: "
    what += (f"it lacks {', '.join(map(repr, lacking))}, which this host sends" if template.agent_ops
             else "its manifest records none of the operations the agent answers (agent_ops)")
    if not template.derived:
        return f"{what}: rebuild it with '{build_command(template.name, config)}'"
    parent = str(template.manifest["parent"].get("name", "?"))
    return (f"{what} (its agent is that of {parent!r}, which it was made from): rebuild {parent!r} with "
            f"'{build_command(parent, config)}', then make {template.name!r} again from it (a repository's warm base "
            "is remade by itself when its parent changes)")
