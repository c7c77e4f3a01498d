"""QEMU behind the Hypervisor interface: `-M pc`, virtio devices, a RAM file, QMP via qemu.qmp.

Both of the host's channels into QEMU (QMP and the guest agent) are socketpairs handed over as
file descriptors: nothing listens on the file system, nothing has to be polled for, and a
connection exists from the first instant, so a pooled QEMU costs no work at restore time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from qemu.qmp import QMPClient, QMPError

from runner.net import netns
from runner.net.addresses import GUEST_MAC, TAP_NAME  # the same in every VM: each has its own namespace
from runner.uidrange import UidLease
from runner.vm import cgroup, jail
from runner.vm.guestwire import PORT_NAME
from runner.vm.hypervisor import Disk, Hypervisor, Launch, Machine, MachineConfig, Snapshot, VMError

log = logging.getLogger(__name__)
T = TypeVar("T")

QMP_TIMEOUT_S = 15.0
CHECKOUT_DRIVE = "cd0"
MIGRATION_TIMEOUT_S = 30.0
# QEMU 7.2 limits an outgoing migration to 32 MiB/s by default: a whole guest's RAM to a local file
# would take 16 s for 512 MiB. Nothing shares this link, so give it all the bandwidth there is.
FILE_MIGRATION_BANDWIDTH = 1 << 40
# TCG's translation buffer: QEMU 7.2 reserves up to 1 GiB per VM by default, and every page it fills
# stays resident. 128 MiB bounds that; on a job mixing python imports, git and a venv (measured,
# alternated in one run, docs/platform.md) it cost no time, while 32 MiB made the job 28% slower.
TCG_TB_SIZE_MIB = 128
DISK_COPY_TIMEOUT_S = 600.0


def qemu_binary() -> str:
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        raise VMError("qemu-system-x86_64 is not installed: apt-get install qemu-system-x86 qemu-utils")
    return path


def _opt_path(path: Path) -> str:
    """A path inside a QEMU option string, where a comma would start a new option."""
    text = str(path)
    if "," in text:
        raise VMError(f"{text}: QEMU option paths cannot contain commas; choose another state directory")
    return text


@dataclass
class Backends:
    """How QEMU reaches the files behind the machine model.

    The bake (trusted, as root) names paths. A restored VM gets descriptors the host opened, named
    `/proc/self/fd/N` or `fd=N`, so its unprivileged VMM needs no path into the state directory.
    `fds` are passed to QEMU and closed in the host once it has them.
    """

    mem: str
    share: bool
    kernel: str
    initrd: str
    drive: str
    netdev: str
    serial: str = "null"
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def device_args(config: MachineConfig, backends: Backends, bake: bool) -> list[str]:
    """The machine model: identical for the bake and every restore, except for backends.

    Part of the template's digest (vmimages.build), so host-side confinement (`sandbox_args`) is not."""
    cpu = "host" if config.accel == "kvm" else "qemu64"
    accel = f"tcg,tb-size={TCG_TB_SIZE_MIB}" if config.accel == "tcg" else config.accel
    args = [
        "-accel", accel,
        "-M", "pc,memory-backend=mem",
        "-cpu", cpu,
        "-smp", str(config.vcpus),
        "-m", f"{config.memory_mib}M",
        "-object",
        f"memory-backend-file,id=mem,size={config.memory_mib}M,"
        f"mem-path={backends.mem},share={'on' if backends.share else 'off'}",
        "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none", "-no-reboot",
        "-kernel", backends.kernel,
        "-initrd", backends.initrd,
        "-append", config.cmdline,
        "-serial", backends.serial,
        "-drive", backends.drive,
        "-device", "virtio-blk-pci,drive=disk0",
        # An empty CD-ROM: each checkout is inserted as a new medium (runner/vm/checkoutdisk.py).
        "-device", "virtio-scsi-pci,id=scsi0",
        "-device", f"scsi-cd,bus=scsi0.0,id={CHECKOUT_DRIVE}",
        "-device", "virtio-serial-pci,id=vser0",
        "-device", f"virtserialport,bus=vser0.0,chardev=agent,name={PORT_NAME}",
        # A new generation ID per VMM: QEMU writes it into the guest after an incoming migration
        # and notifies the guest, whose kernel then reseeds its RNG.
        "-device", f"vmgenid,id=vmgenid0,guid={'auto' if bake else uuid.uuid4()}",
        "-object", "rng-random,id=rng0,filename=/dev/urandom",
        "-device", "virtio-rng-pci,rng=rng0",
    ]
    if config.network:
        args += ["-netdev", backends.netdev, "-device", f"virtio-net-pci,netdev=net0,mac={GUEST_MAC}"]
    return args


def sandbox_args() -> list[str]:
    """seccomp for every QEMU we start: no exec, no privilege change, no scheduler or obsolete calls."""
    return ["-sandbox", jail.SANDBOX]


def bake_backends(config: MachineConfig, mem_file: Path, launch: Launch) -> Backends:
    """The bake's files by path; it has no tap to attach to (the netdev backend is not in the snapshot)."""
    return Backends(
        mem=_opt_path(mem_file),
        share=True,
        kernel=_opt_path(config.kernel),
        initrd=_opt_path(config.initrd),
        drive=f"file={_opt_path(launch.disk)},if=none,id=disk0,format={launch.disk_format},cache=unsafe",
        netdev="hubport,id=net0,hubid=0",
        serial=f"file:{_opt_path(launch.console_log)}" if launch.console_log else "null",
    )


def restore_backends(snapshot: Snapshot, launch: Launch, ram_fd: int, user: jail.VMUser) -> Backends:
    """A restore's files as descriptors: the template's read-only, the RAM a sealed memfd (mapped
    private; `ram_fd` is handed over, closed with the others), the VM's own overlay handed to the VM
    user, the tap opened in the VM's namespace."""
    backends = Backends(mem="", share=False, kernel="", initrd="", drive="", netdev="")
    try:
        def hand(fd: int) -> str:
            backends.fds.append(fd)
            return jail.proc_fd(fd)

        backends.mem = hand(ram_fd)
        backends.kernel = hand(os.open(snapshot.config.kernel, os.O_RDONLY | os.O_CLOEXEC))
        backends.initrd = hand(os.open(snapshot.config.initrd, os.O_RDONLY | os.O_CLOEXEC))
        base = hand(os.open(snapshot.disk, os.O_RDONLY | os.O_CLOEXEC))
        overlay_fd = os.open(launch.disk, os.O_RDWR | os.O_CLOEXEC)
        overlay = hand(overlay_fd)
        os.fchown(overlay_fd, user.uid, user.gid)
        backends.drive = (f"file={overlay},if=none,id=disk0,format={launch.disk_format},cache=unsafe,"
                          f"backing.driver=raw,backing.file.filename={base}")
        if snapshot.config.network:
            tap = netns.run_in(launch.netns, lambda: jail.open_tap(TAP_NAME))
            backends.fds.append(tap)
            backends.netdev = f"tap,id=net0,fd={tap},vhost=off"
    except BaseException:
        backends.close()
        raise
    return backends


def fold_backends(target: Snapshot, user: jail.VMUser, mem_bytes: int) -> Backends:
    """A fold's files as descriptors: a new RAM file the VM user may write (mapped shared), the
    template's kernel and initrd and the new disk read-only; a hub port stands in for the tap."""
    backends = Backends(mem="", share=True, kernel="", initrd="", drive="", netdev="hubport,id=net0,hubid=0")
    try:
        def hand(fd: int) -> str:
            backends.fds.append(fd)
            return jail.proc_fd(fd)

        mem_fd = os.open(target.mem_file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        backends.mem = hand(mem_fd)
        os.ftruncate(mem_fd, mem_bytes)
        os.fchown(mem_fd, user.uid, user.gid)
        backends.kernel = hand(os.open(target.config.kernel, os.O_RDONLY | os.O_CLOEXEC))
        backends.initrd = hand(os.open(target.config.initrd, os.O_RDONLY | os.O_CLOEXEC))
        disk = hand(os.open(target.disk, os.O_RDONLY | os.O_CLOEXEC))
        backends.drive = f"file={disk},if=none,id=disk0,format=raw,read-only=on"
    except BaseException:
        backends.close()
        raise
    return backends


class Monitor:
    """QMP over an already connected socket, on an event loop of its own.

    qemu.qmp is asyncio; its sync shim borrows the creating thread's loop, and VMs are restored by
    pool threads and destroyed by others, so two machines could end up driving one loop from two
    threads. A private loop per machine, used under a lock, keeps each machine's QMP to itself.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = QMPClient()
        self._lock = threading.Lock()
        self._run(self._client.connect(sock))

    def _run(self, coroutine: Awaitable[T], timeout: float = QMP_TIMEOUT_S) -> T:
        return self._loop.run_until_complete(asyncio.wait_for(coroutine, timeout))

    def execute(self, command: str, arguments: dict[str, object]) -> object:
        with self._lock:
            return self._run(self._client.execute(command, arguments or None))

    def give_fd(self, fd: int, name: str) -> None:
        """Hand QEMU an open file (SCM_RIGHTS) under `name`, for a `fd:<name>` migration URI."""
        with self._lock:
            self._client.send_fd_scm(fd)
            self._run(self._client.execute("getfd", {"fdname": name}))

    def add_fd(self, fd: int) -> int:
        """Hand QEMU an open file (SCM_RIGHTS) as a new fd set; its number, for `/dev/fdset/N`."""
        with self._lock:
            self._client.send_fd_scm(fd)
            reply = self._run(self._client.execute("add-fd", {}))
        # QEMU's schema: add-fd returns AddfdInfo, {"fdset-id": int, "fd": int}
        assert isinstance(reply, dict) and isinstance(reply["fdset-id"], int), reply
        return reply["fdset-id"]

    def close(self) -> None:
        with self._lock:
            try:
                self._run(self._client.disconnect(), timeout=5)
            except (TimeoutError, QMPError, OSError, EOFError):
                pass  # QEMU is gone: there is nobody left to say goodbye to
            self._loop.close()


class QemuMachine(Machine):
    """A QEMU process, forked by the jail's long-lived spawner thread, confined by `jail.confine`,
    running as `user` (its uid held by `lease`), in `group` and writing files of at most
    `max_file_bytes` if given (a restored VM)."""

    def __init__(self, argv: list[str], launch: Launch, backends: Backends, user: jail.VMUser | None = None,
                 group: cgroup.VMCgroup | None = None, lease: UidLease | None = None,
                 max_file_bytes: int | None = None) -> None:
        qmp_host, qmp_vm = socket.socketpair()
        agent_host, agent_vm = socket.socketpair()
        argv = argv + [
            # The VM directory in the command line is how a later engine's sweep recognises this
            # process (sweep.processes_under): all its files are descriptors, not paths.
            "-name", f"guest={_opt_path(launch.vm_dir)}",
            "-chardev", f"socket,id=agent,fd={agent_vm.fileno()}",
            "-chardev", f"socket,id=qmp,fd={qmp_vm.fileno()}",
            "-mon", "chardev=qmp,mode=control",
        ]
        self.argv = argv
        self.group = group
        self.lease = lease
        self.disk = launch.disk
        stderr = open(launch.vm_dir / "qemu.stderr", "wb")
        try:
            self.proc = jail.spawner().run(lambda: subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                # Nothing of the service's: not its environment (tokens, key paths), not its cwd.
                env={},
                cwd="/",
                pass_fds=(agent_vm.fileno(), qmp_vm.fileno(), *backends.fds),
                start_new_session=True,  # a Ctrl-C aimed at the service is not aimed at its VMs
                preexec_fn=jail.confine(user, max_file_bytes),
            ))
        except subprocess.SubprocessError as exc:  # confine() failed in the child; QEMU never ran
            raise VMError(f"could not confine QEMU (network namespace, user, parent-death signal): {exc}") from None
        finally:
            stderr.close()
            agent_vm.close()
            qmp_vm.close()
            backends.close()
        self.pid = self.proc.pid
        self.agent = agent_host
        self._qmp_sock = qmp_host
        self._qmp: Monitor | None = None
        self._qmp_lock = threading.Lock()
        self._stderr_path = launch.vm_dir / "qemu.stderr"
        if group is not None:
            try:
                # The guest runs only after restore and `cont`, long after this: it never runs outside.
                group.add(self.pid)
            except OSError as exc:
                self.kill()
                raise VMError(f"cannot move QEMU into its cgroup: {exc}") from None

    def _monitor(self) -> Monitor:
        """QMP, connected on first use (a pooled QEMU may never need it before it is killed)."""
        with self._qmp_lock:
            if self._qmp is None:
                try:
                    self._qmp = Monitor(self._qmp_sock)
                except (TimeoutError, QMPError, OSError, EOFError) as exc:
                    raise VMError(f"QEMU did not answer on QMP: {exc}{self._stderr_tail()}") from None
            return self._qmp

    def qmp(self, command: str, **arguments: object) -> object:
        try:
            return self._monitor().execute(command, arguments)
        except (TimeoutError, QMPError, OSError, EOFError) as exc:
            raise VMError(f"QMP {command} failed: {exc}{self._stderr_tail()}") from None

    def _give_file(self, path: Path, flags: int, name: str) -> None:
        """Open `path` here and hand QEMU the descriptor: with spawn=deny it cannot run `exec:cat`."""
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            self._monitor().give_fd(fd, name)
        except (TimeoutError, QMPError, OSError, EOFError) as exc:
            raise VMError(f"could not hand QEMU {path}: {exc}{self._stderr_tail()}") from None
        finally:
            os.close(fd)

    def change_medium(self, image: Path) -> None:
        """Put `image` in the CD-ROM, read-only, replacing any earlier medium (QEMU opens the
        descriptor set `/dev/fdset/N`, a dup of our descriptor: it cannot open host paths)."""
        fd = os.open(image, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fdset = self._monitor().add_fd(fd)
        except (TimeoutError, QMPError, OSError, EOFError) as exc:
            raise VMError(f"could not hand QEMU {image}: {exc}{self._stderr_tail()}") from None
        finally:
            os.close(fd)
        try:
            self.qmp("blockdev-change-medium", id=CHECKOUT_DRIVE, filename=f"/dev/fdset/{fdset}", format="raw",
                     **{"read-only-mode": "read-only"})
        finally:
            self.qmp("remove-fd", **{"fdset-id": fdset})  # the medium keeps its own descriptor

    def _stderr_tail(self) -> str:
        try:
            tail = self._stderr_path.read_bytes()[-800:].decode(errors="replace").strip()
        except OSError:
            return ""
        return f"\nqemu said: {tail}" if tail else ""

    def _wait_migration(self) -> None:
        deadline = time.monotonic() + MIGRATION_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = self.qmp("query-migrate")
            status = reply.get("status") if isinstance(reply, dict) else None  # MigrationInfo, a dict
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise VMError(f"migration {status}{self._stderr_tail()}")
            time.sleep(0.002)
        raise VMError(f"migration did not finish in {MIGRATION_TIMEOUT_S:.0f} s")

    def _ignore_shared(self) -> None:
        caps = [{"capability": "x-ignore-shared", "state": True}]
        self.qmp("migrate-set-capabilities", capabilities=caps)

    def restore(self, snapshot: Snapshot) -> None:
        self._ignore_shared()
        self._give_file(snapshot.state_file, os.O_RDONLY, "state")
        self.qmp("migrate-incoming", uri="fd:state")
        self._wait_migration()

    def resume(self) -> None:
        self.qmp("cont")

    def snapshot(self, state_file: Path) -> None:
        self._ignore_shared()
        self.qmp("stop")
        self._give_file(state_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "state")
        self.qmp("migrate", uri="fd:state")
        self._wait_migration()

    def save(self, stream: Path) -> None:
        """Pause and write the whole machine, RAM included, to `stream`: a restored VM maps its RAM
        privately, so its pages are nowhere but in this process. `resume()` lets it go on."""
        self.qmp("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": False}])
        self.qmp("migrate-set-parameters", **{"max-bandwidth": FILE_MIGRATION_BANDWIDTH})
        self.qmp("stop")
        self._give_file(stream, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "state")
        self.qmp("migrate", uri="fd:state")
        self._wait_migration()

    def export_disk(self, base: Path, out: Path) -> None:
        """`qemu-img convert` of this VM's overlay over `base` into a sparse raw image, under this VM's
        uid and confinement, with the backing file named here (never the one in the overlay's header)."""
        if self.lease is None:
            raise VMError("only a restored VM (with a VM uid of its own) can be snapshotted, not a template's bake")
        export_disk(jail.VMUser(jail.VM_USER, self.lease.uid, jail.vm_user().gid), self.disk, base, out)

    def eject_medium(self) -> None:
        """Take the checkout drive's medium out and close the empty tray, as in the template."""
        self.qmp("blockdev-open-tray", id=CHECKOUT_DRIVE, force=True)
        self.qmp("blockdev-remove-medium", id=CHECKOUT_DRIVE)
        self.qmp("blockdev-close-tray", id=CHECKOUT_DRIVE)

    def set_spare(self, spare: bool) -> None:
        if self.group is None:
            return
        try:
            self.group.weigh(cgroup.SPARE_CPU_WEIGHT if spare else cgroup.JOB_CPU_WEIGHT)
        except OSError as exc:
            raise VMError(f"cannot set the VM's CPU weight: {exc}") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.lease is not None:  # reaped: no process runs as its uid any more
            self.lease.close()
        with self._qmp_lock:
            monitor, self._qmp = self._qmp, None
        if monitor is not None:
            monitor.close()
        for sock in (self.agent, self._qmp_sock):
            sock.close()
        if self.group is not None:
            try:
                self.group.remove()
            except VMError as exc:  # the next engine's start-up sweep removes it
                log.warning("%s", exc)


class QemuHypervisor(Hypervisor):
    """QEMU with seccomp everywhere; restored VMs also run as a uid and in a cgroup of their own.

    The bake boots our own template recipe (no job's code) as root: it must write the RAM file
    it shares with the guest, which no restore may ever do.
    """

    name = "qemu"

    def __init__(self) -> None:
        self.binary = qemu_binary()
        self._overlays = EmptyOverlays()
        self._version: str | None = None
        self._ram: dict[Path, int] = {}  # template RAM file -> its sealed memfd
        self._ram_lock = threading.Lock()

    def version(self) -> str:
        if self._version is None:
            out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True)
            self._version = out.stdout.splitlines()[0].strip()
        return self._version

    def boot(self, config: MachineConfig, mem_file: Path, launch: Launch) -> Machine:
        backends = bake_backends(config, mem_file, launch)
        args = [*device_args(config, backends, bake=True), *sandbox_args()]
        argv = [self.binary, *args]
        return QemuMachine(argv, launch, backends)

    def spawn(self, snapshot: Snapshot, launch: Launch) -> Machine:
        lease = jail.lease_uid()
        user = jail.VMUser(jail.VM_USER, lease.uid, jail.vm_user().gid)
        try:
            backends = restore_backends(snapshot, launch, self._sealed_ram(snapshot.mem_file), user)
        except BaseException:
            lease.close()
            raise
        try:
            args = [*device_args(snapshot.config, backends, bake=False), *sandbox_args(), "-incoming", "defer"]
            argv = [self.binary, *args]  # never in the slot's namespace: the tap is a descriptor
            config = snapshot.config
            group = cgroup.VMCgroup.create(cgroup.scope_for(launch.vm_dir.parent), launch.vm_dir.name,
                                           cgroup.limits_for(config.vcpus, config.memory_mib))
        except BaseException:
            backends.close()
            lease.close()
            raise
        try:
            max_file_bytes = snapshot.disk.stat().st_size + jail.FILE_SIZE_SLACK  # the overlay's most
            machine = QemuMachine(argv, launch, backends, user, group, lease, max_file_bytes)
        except BaseException:
            group.remove()
            lease.close()
            raise
        try:
            machine.set_spare(True)  # until a job claims it (Engine.create)
            # QMP answers once QEMU's main loop runs, i.e. when its start-up is over: a VMM spawned ahead
            # is then ready for a restore, and no longer busy on the cores a job's VM is using.
            machine._monitor()
        except BaseException:
            machine.kill()
            raise
        return machine

    def overlay(self, base: Path, vm_dir: Path) -> Disk:
        disk = Disk(vm_dir / "disk.qcow2", "qcow2")
        self._overlays.write(base, disk.path)
        return disk

    def fold(self, stream: Path, target: Snapshot, work_dir: Path) -> None:
        """Make a template variant out of a whole-machine stream (`QemuMachine.save`): a confined
        QEMU loads it into `target.mem_file`, mapped shared, and saves only the device state to
        `target.state_file`; the guest never runs in it. `target.disk` must already exist."""
        config = target.config
        lease = jail.lease_uid()
        user = jail.VMUser(jail.VM_USER, lease.uid, jail.vm_user().gid)
        mem_bytes = config.memory_mib << 20
        try:
            backends = fold_backends(target, user, mem_bytes)
        except BaseException:
            lease.close()
            raise
        try:
            args = [*device_args(config, backends, bake=False), *sandbox_args(), "-incoming", "defer"]
            group = cgroup.VMCgroup.create(cgroup.scope_for(work_dir.parent), work_dir.name,
                                           cgroup.limits_for(config.vcpus, config.memory_mib))
        except BaseException:
            backends.close()
            lease.close()
            raise
        try:
            machine = QemuMachine([self.binary, *args], Launch(vm_dir=work_dir, disk=target.disk, disk_format="raw"),
                                  backends, user, group, lease, mem_bytes + jail.FILE_SIZE_SLACK)
        except BaseException:
            group.remove()
            lease.close()
            raise
        try:
            machine.qmp("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": False}])
            machine._give_file(stream, os.O_RDONLY, "state")
            machine.qmp("migrate-incoming", uri="fd:state")
            machine._wait_migration()
            machine.snapshot(target.state_file)  # x-ignore-shared: the RAM stays in the shared file
        finally:
            machine.kill()
        os.chown(target.mem_file, 0, 0)

    def _sealed_ram(self, mem_file: Path) -> int:
        """The template's RAM as a sealed memfd, made once per file and kept for every later restore; the
        caller gets a descriptor of its own (a dup made under the lock), so dropping the copy meanwhile
        (`forget`, `_drop_unpublished`) never closes, or lets another file reuse, the one it hands QEMU."""
        with self._ram_lock:
            fd = self._ram.get(mem_file)
            if fd is None:
                self._drop_unpublished()
                fd = self._ram[mem_file] = jail.sealed_copy(mem_file)
            return os.dup(fd)

    def forget(self, snapshot: Snapshot) -> None:
        """The RAM copy of a template being removed goes now, not at the next new template's first restore
        (until then it held the template's used RAM, per template removed meanwhile)."""
        with self._ram_lock:
            fd = self._ram.pop(snapshot.mem_file, None)
        if fd is not None:
            os.close(fd)
        self._overlays.forget(snapshot.disk)

    def _drop_unpublished(self) -> None:
        """Free the copies of templates that a rebuild removed (VMs already running keep their mapping)."""
        for path in [p for p in self._ram if not p.exists()]:
            os.close(self._ram.pop(path))


class EmptyOverlays:
    """A VM's disk overlay is the same empty qcow2 for every VM of a template disk: `qemu-img create`
    runs once per disk (10-15 ms of a restore under load, measured) and each VM gets a copy of its bytes.
    The header's backing name is never used: restore_backends names the backing file by descriptor."""

    def __init__(self) -> None:
        self._images: dict[Path, bytes] = {}
        self._lock = threading.Lock()

    def write(self, base: Path, overlay: Path) -> None:
        with self._lock:
            image = self._images.get(base)
        if image is None:
            make_overlay(base, overlay)
            overlay.chmod(0o600)  # as the copies: only root (and, once handed over, its VM's uid) reads it
            image = overlay.read_bytes()
            with self._lock:
                for gone in [p for p in self._images if not p.exists()]:  # rebuilt templates' disks
                    del self._images[gone]
                self._images[base] = image
            return
        with os.fdopen(os.open(overlay, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as out:
            out.write(image)

    def forget(self, base: Path) -> None:
        with self._lock:
            self._images.pop(base, None)


def make_overlay(base: Path, overlay: Path) -> None:
    proc = subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw", str(overlay)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise VMError(f"qemu-img could not create the VM's disk overlay: {proc.stderr.strip()}")


def export_disk(user: jail.VMUser, overlay: Path, base: Path, out: Path) -> None:
    """`overlay` over `base` into `out`, a new raw image exactly `base`'s size, sparse. The overlay was
    written by the VM's QEMU, which runs the guest, so `qemu-img` reads it as `user` (that VM's uid)
    with the VM's confinement and a file size limit."""
    fds = [os.open(overlay, os.O_RDONLY | os.O_CLOEXEC), os.open(base, os.O_RDONLY | os.O_CLOEXEC),
           os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)]
    try:
        os.fchown(fds[2], user.uid, user.gid)
        src, backing, dst = (jail.proc_fd(fd) for fd in fds)
        argv = [shutil.which("qemu-img") or "qemu-img", "convert", "-U", "-q", "-O", "raw", "-S", "4k",
                "--image-opts", f"driver=qcow2,file.driver=file,file.filename={src},"
                f"backing.driver=raw,backing.file.driver=file,backing.file.filename={backing}", dst]
        size = base.stat().st_size
        proc = jail.spawner().run(lambda: subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={}, cwd="/",
            pass_fds=fds, preexec_fn=jail.confine(user, size + jail.FILE_SIZE_SLACK)))
        try:
            _, err = proc.communicate(timeout=DISK_COPY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise VMError(f"copying the VM's disk took longer than {DISK_COPY_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            raise VMError(f"qemu-img could not copy the VM's disk: {err.decode(errors='replace').strip()[-500:]}")
        os.fchown(fds[2], 0, 0)
        if os.fstat(fds[2]).st_size != size:
            raise VMError(f"the VM's disk copy is {os.fstat(fds[2]).st_size} bytes, not the template's {size}")
    finally:
        for fd in fds:
            os.close(fd)
