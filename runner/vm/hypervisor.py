"""What the VM engine needs from a hypervisor, so that QEMU is one implementation among others.

The lifecycle is the one snapshot-restore VMMs share (QEMU with `-incoming`, Firecracker's
snapshot/load): start a process that has the template's exact device model but no guest state yet,
load the template's device state over the shared RAM file, resume. A Firecracker backend would
map `spawn` to starting the process with its API socket, `restore` to `PUT /snapshot/load` with
a file memory backend, and `resume` to `PATCH /vm`.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from runner.vm.errors import VMError

__all__ = ["Disk", "Hypervisor", "Launch", "Machine", "MachineConfig", "Snapshot", "VMError"]


@dataclass(frozen=True)
class MachineConfig:
    """Everything that must be identical between a template and every restore of it."""

    kernel: Path
    initrd: Path
    cmdline: str
    memory_mib: int
    vcpus: int
    network: bool
    accel: str  # "kvm" | "tcg"


@dataclass(frozen=True)
class Snapshot:
    """A baked template variant: its RAM file, device state and the disk both were taken with."""

    config: MachineConfig
    mem_file: Path
    state_file: Path
    disk: Path


@dataclass(frozen=True)
class Disk:
    """A restored VM's own writable disk over its template's read-only one."""

    path: Path  # in the VM's directory, gone with it
    format: str  # "raw" | "qcow2": what `Launch.disk_format` says


@dataclass(frozen=True)
class Launch:
    """Per-VM choices that may differ from the template's."""

    vm_dir: Path  # private to this VM: overlay, console log
    disk: Path  # the template disk itself (bake) or a per-VM overlay (restore)
    disk_format: str  # "raw" | "qcow2"
    netns: str = ""  # that namespace's name: the host opens the VM's tap there
    console_log: Path | None = None


class Machine(ABC):
    """One VMM process and the guest inside it."""

    pid: int
    agent: socket.socket  # the host end of the guest agent's channel

    @abstractmethod
    def restore(self, snapshot: Snapshot) -> None:
        """Load the snapshot's device state over its RAM file (mapped copy-on-write)."""

    @abstractmethod
    def resume(self) -> None:
        """Let the guest run."""

    @abstractmethod
    def snapshot(self, state_file: Path) -> None:
        """Pause for good and write device state; the RAM stays in the shared RAM file."""

    @abstractmethod
    def save(self, stream: Path) -> None:
        """Pause and write the whole machine, RAM included, to `stream` (for `Hypervisor.fold`)."""

    @abstractmethod
    def export_disk(self, base: Path, out: Path) -> None:
        """Write the VM's disk as it is now (its own disk over `base`, the template disk it was restored
        with) to `out`, a new raw image of `base`'s size, for a template made from the VM. Read with the
        VM's own confinement: its disk was written by the process that runs the guest."""

    @abstractmethod
    def eject_medium(self) -> None:
        """Leave the checkout drive empty, as it is in a template."""

    @abstractmethod
    def change_medium(self, image: Path) -> None:
        """Insert `image` (a raw disk image, read-only) as the checkout drive's new medium."""

    @abstractmethod
    def set_spare(self, spare: bool) -> None:
        """A spare VM (spawned ahead or pooled, no job's yet) takes only the CPU its engine's other VMs leave;
        a job's VM its full share."""

    @abstractmethod
    def alive(self) -> bool:
        """Whether the VMM process still runs."""

    @abstractmethod
    def exit_status(self) -> int | None:
        """The VMM's exit status once it has ended (negative: killed by that signal)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the VMM at once and reap it. Idempotent."""


class Hypervisor(ABC):
    name: str

    @abstractmethod
    def boot(self, config: MachineConfig, mem_file: Path, launch: Launch) -> Machine:
        """Cold-boot a template machine whose RAM lives in `mem_file` (shared, so it can be snapshotted)."""

    @abstractmethod
    def spawn(self, snapshot: Snapshot, launch: Launch) -> Machine:
        """Start a VMM ready to `restore(snapshot)`; cheap to keep a few of these waiting.

        Every spawned VMM gets a new VM generation ID, which the guest kernel sees after the restore
        and reseeds its RNG from: two clones of one template must never share random numbers.
        """

    @abstractmethod
    def overlay(self, base: Path, vm_dir: Path) -> Disk:
        """A new VM's own disk in `vm_dir`, over the template's read-only disk `base` (QEMU: an empty
        qcow2 overlay; Firecracker, which has no backing files, would make a reflinked copy)."""

    @abstractmethod
    def fold(self, stream: Path, target: Snapshot, work_dir: Path) -> None:
        """Turn a `Machine.save` stream into the RAM file and device state of `target`, a new
        template variant whose disk already exists; `work_dir` is private to this run."""

    @abstractmethod
    def forget(self, snapshot: Snapshot) -> None:
        """Drop whatever is kept to restore `snapshot` faster (QEMU: its RAM's sealed copy, its empty
        overlay): its template is about to be removed and no restore will ask for it again."""

    @abstractmethod
    def version(self) -> str:
        """The VMM's version: a template is only restorable by the version that baked it."""
