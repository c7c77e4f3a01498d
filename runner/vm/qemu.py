"""QEMU behind the Hypervisor interface: `-M pc`, virtio devices, a RAM file, QMP via qemu.qmp.

Both of the host's channels into QEMU (QMP and the guest agent) are socketpairs handed over as
file descriptors: nothing listens on the file system, nothing has to be polled for, and a
connection exists from the first instant, so a pooled QEMU costs no work at restore time.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

from qemu.qmp import QMPClient, QMPError

from runner.net.addresses import GUEST_MAC  # the same in every VM: each has its own namespace
from runner.vm.hypervisor import Hypervisor, Launch, Machine, MachineConfig, Snapshot, VMError
from vmimages.guest.protocol import PORT_NAME

log = logging.getLogger(__name__)

QMP_TIMEOUT_S = 15.0
MIGRATION_TIMEOUT_S = 30.0


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


def device_args(config: MachineConfig, mem_file: Path, share: bool, launch: Launch, bake: bool) -> list[str]:
    """The machine model: identical for the bake and every restore, except for backends."""
    cpu = "host" if config.accel == "kvm" else "qemu64"
    args = [
        "-accel", config.accel,
        "-M", "pc,memory-backend=mem",
        "-cpu", cpu,
        "-smp", str(config.vcpus),
        "-m", f"{config.memory_mib}M",
        "-object",
        f"memory-backend-file,id=mem,size={config.memory_mib}M,"
        f"mem-path={_opt_path(mem_file)},share={'on' if share else 'off'}",
        "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none", "-no-reboot",
        "-kernel", _opt_path(config.kernel),
        "-initrd", _opt_path(config.initrd),
        "-append", config.cmdline,
        "-serial", f"file:{_opt_path(launch.console_log)}" if launch.console_log else "null",
        "-drive",
        f"file={_opt_path(launch.disk)},if=none,id=disk0,format={launch.disk_format},cache=unsafe",
        "-device", "virtio-blk-pci,drive=disk0",
        "-device", "virtio-serial-pci,id=vser0",
        "-device", f"virtserialport,bus=vser0.0,chardev=agent,name={PORT_NAME}",
        # A new generation ID per VMM: QEMU writes it into the guest after an incoming migration
        # and notifies the guest, whose kernel then reseeds its RNG.
        "-device", f"vmgenid,id=vmgenid0,guid={'auto' if bake else uuid.uuid4()}",
        "-object", "rng-random,id=rng0,filename=/dev/urandom",
        "-device", "virtio-rng-pci,rng=rng0",
    ]
    if config.network:
        # The bake has no tap to attach to; the netdev backend is not part of the snapshot.
        netdev = "hubport,id=net0,hubid=0" if bake else "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off"
        args += ["-netdev", netdev, "-device", f"virtio-net-pci,netdev=net0,mac={GUEST_MAC}"]
    return args


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

    def _run(self, coroutine, timeout: float = QMP_TIMEOUT_S):
        return self._loop.run_until_complete(asyncio.wait_for(coroutine, timeout))

    def execute(self, command: str, arguments: dict) -> object:
        with self._lock:
            return self._run(self._client.execute(command, arguments or None))

    def close(self) -> None:
        with self._lock:
            try:
                self._run(self._client.disconnect(), timeout=5)
            except (QMPError, OSError, EOFError, asyncio.TimeoutError):
                pass  # QEMU is gone: there is nobody left to say goodbye to
            self._loop.close()


class QemuMachine(Machine):
    def __init__(self, argv: list[str], launch: Launch) -> None:
        qmp_host, qmp_vm = socket.socketpair()
        agent_host, agent_vm = socket.socketpair()
        argv = argv + [
            "-chardev", f"socket,id=agent,fd={agent_vm.fileno()}",
            "-chardev", f"socket,id=qmp,fd={qmp_vm.fileno()}",
            "-mon", "chardev=qmp,mode=control",
        ]
        self.argv = [*launch.netns_prefix, *argv]
        stderr = open(launch.vm_dir / "qemu.stderr", "wb")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                pass_fds=(agent_vm.fileno(), qmp_vm.fileno()),
                start_new_session=True,  # a Ctrl-C aimed at the service is not aimed at its VMs
            )
        finally:
            stderr.close()
            agent_vm.close()
            qmp_vm.close()
        self.pid = self.proc.pid
        self.agent = agent_host
        self._qmp_sock = qmp_host
        self._qmp: Monitor | None = None
        self._qmp_lock = threading.Lock()
        self._stderr_path = launch.vm_dir / "qemu.stderr"

    def _monitor(self) -> Monitor:
        """QMP, connected on first use (a pooled QEMU may never need it before it is killed)."""
        with self._qmp_lock:
            if self._qmp is None:
                try:
                    self._qmp = Monitor(self._qmp_sock)
                except (QMPError, OSError, EOFError, asyncio.TimeoutError) as exc:
                    raise VMError(f"QEMU did not answer on QMP: {exc}{self._stderr_tail()}") from None
            return self._qmp

    def qmp(self, command: str, **arguments):
        try:
            return self._monitor().execute(command, arguments)
        except (QMPError, OSError, EOFError, asyncio.TimeoutError) as exc:
            raise VMError(f"QMP {command} failed: {exc}{self._stderr_tail()}") from None

    def _stderr_tail(self) -> str:
        try:
            tail = self._stderr_path.read_bytes()[-800:].decode(errors="replace").strip()
        except OSError:
            return ""
        return f"\nqemu said: {tail}" if tail else ""

    def _wait_migration(self) -> None:
        deadline = time.monotonic() + MIGRATION_TIMEOUT_S
        while time.monotonic() < deadline:
            status = self.qmp("query-migrate").get("status")
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
        self.qmp("migrate-incoming", uri="exec:cat " + shlex.quote(str(snapshot.state_file)))
        self._wait_migration()

    def resume(self) -> None:
        self.qmp("cont")

    def snapshot(self, state_file: Path) -> None:
        self._ignore_shared()
        self.qmp("stop")
        self.qmp("migrate", uri="exec:cat > " + shlex.quote(str(state_file)))
        self._wait_migration()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_status(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with self._qmp_lock:
            monitor, self._qmp = self._qmp, None
        if monitor is not None:
            monitor.close()
        for sock in (self.agent, self._qmp_sock):
            sock.close()


class QemuHypervisor(Hypervisor):
    name = "qemu"

    def __init__(self) -> None:
        self.binary = qemu_binary()
        self._version: str | None = None

    def version(self) -> str:
        if self._version is None:
            out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True)
            self._version = out.stdout.splitlines()[0].strip()
        return self._version

    def boot(self, config: MachineConfig, mem_file: Path, launch: Launch) -> Machine:
        args = device_args(config, mem_file, share=True, launch=launch, bake=True)
        return QemuMachine([self.binary, *args], launch)

    def spawn(self, snapshot: Snapshot, launch: Launch) -> Machine:
        args = device_args(snapshot.config, snapshot.mem_file, share=False, launch=launch, bake=False)
        return QemuMachine([self.binary, *args, "-incoming", "defer"], launch)
