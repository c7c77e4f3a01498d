"""A restored VM's QEMU is confined: seccomp, an unprivileged user, no writable template file, its own
cgroup with limits; and the template RAM it maps is a sealed copy nobody can write."""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.commands import doctor as cli
from runner.sandbox.port import VMRequest
from runner.vm import cgroup, jail, qemu
from runner.vm.errors import VMError


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _writable_files(pid: int) -> list[str]:
    """Paths of the regular files `pid` holds open for writing."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        flags = int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        if target.startswith("/") and flags & os.O_ACCMODE != os.O_RDONLY:
            found.append(target)
    return found


def _wait_exit(machine, timeout: float = 30.0) -> int | None:
    deadline = time.monotonic() + timeout
    while machine.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    return machine.exit_status()


def test_restored_qemu_is_unprivileged_sandboxed_and_in_a_limited_cgroup(make_engine, template_store):
    engine = make_engine(pool_size=0)
    vm = engine.create(VMRequest())
    pid = vm.machine.pid
    status = _status(pid)
    uid = int(status["Uid"].split()[0])
    assert uid in jail.VM_UIDS and status["Uid"].split() == [str(uid)] * 4
    assert status["Gid"].split() == [str(jail.vm_user().gid)] * 4 and status["Groups"] == ""
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    assert status["Seccomp_filters"] == "2"  # the jail's own, then QEMU's -sandbox
    assert status["CapEff"] == "0000000000000000"

    template_dir = str(template_store.get("base").path)
    writable = _writable_files(pid)
    assert [f for f in writable if f.startswith(template_dir)] == [], "QEMU holds a template file open for writing"
    assert str(vm.dir / "disk.qcow2") in writable  # its own overlay, and that is all it writes

    paths = vm.machine.group.paths
    assert paths and all(str(pid) in (p / "cgroup.procs").read_text().split() for p in paths)
    limits = cgroup.limits_for(vm.snapshot.config.vcpus, vm.snapshot.config.memory_mib)
    if vm.machine.group.version == "v1":
        cpu, memory, pids = paths
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == int(limits.cpus * cgroup.CPU_PERIOD_US)
        assert int((memory / "memory.limit_in_bytes").read_text()) == limits.memory_bytes
        assert int((pids / "pids.max").read_text()) == limits.pids
    else:
        assert (paths[0] / "memory.max").read_text().strip() == str(limits.memory_bytes)
        assert (paths[0] / "pids.max").read_text().strip() == str(limits.pids)

    engine.destroy(vm)
    assert [p for p in paths if p.exists()] == [], "the VM's cgroup outlived it"


def test_a_qemu_that_tries_to_exec_is_killed_by_seccomp(make_engine):
    engine = make_engine(pool_size=0)
    vm = engine.create(VMRequest())
    # An outgoing migration to "exec:" makes QEMU fork and exec a shell: what an escaped guest would do.
    with pytest.raises(VMError, match="QMP migrate failed"):
        vm.machine.qmp("migrate", uri="exec:/bin/true")
    assert _wait_exit(vm.machine) == -signal.SIGSYS
    vm.fail("the agent channel closed")
    assert "killed by its seccomp sandbox" in vm.describe_failure()
    engine.destroy(vm)


def _punch_hole(fd: int, offset: int, length: int) -> int:
    """fallocate(PUNCH_HOLE | KEEP_SIZE): would zero the template's pages under every VM; 0 or errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return 0 if libc.fallocate(fd, 0x02 | 0x01, offset, length) == 0 else ctypes.get_errno()


def test_template_ram_copy_is_sealed_but_maps_privately_writable(tmp_path):
    ram = tmp_path / "mem.ram"
    with open(ram, "wb") as f:  # data, a zero chunk, a hole, data
        f.write(b"A" * 4096 + bytes(jail._COPY_CHUNK))
        f.seek(8 << 20)
        f.write(b"B" * 4096)
    fd = jail.sealed_copy(ram)
    try:
        assert os.pread(fd, os.fstat(fd).st_size, 0) == ram.read_bytes()
        with pytest.raises(PermissionError, match=r"\[Errno 1\] Operation not permitted"):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError, match=r"\[Errno 1\] Operation not permitted"):
            os.ftruncate(fd, 0)
        # what a VMM holds: the copy reopened read-write through /proc; the seals are the inode's
        reopened = os.open(jail.proc_fd(fd), os.O_RDWR)
        try:
            with pytest.raises(PermissionError, match=r"\[Errno 1\] Operation not permitted"):
                os.pwrite(reopened, b"x", 0)
            assert _punch_hole(reopened, 0, 4096) == errno.EPERM
        finally:
            os.close(reopened)
        with pytest.raises(PermissionError, match=r"\[Errno 1\] Operation not permitted"):
            mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        private = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        private[:1] = b"z"  # the guest's writes land in its own copy-on-write pages
        private.close()
        assert os.pread(fd, 1, 0) == b"A"
    finally:
        os.close(fd)


SANDBOX_FLAGS = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"


def test_doctor_reports_sandbox_privilege_drop_and_cgroup_version(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MICROVM_CHECK_STATE", str(tmp_path / "state"))
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)  # a cgroup v2 host
    cli.cmd_doctor(argparse.Namespace(selftest=False, config=tmp_path / "service.yml"))
    out = capsys.readouterr().out
    # the literal flags, not jail.SANDBOX: a change to the constant (say, spawn=deny dropped) must fail here,
    # and every QEMU gets the same flags that doctor reports
    assert f"QEMU seccomp sandbox: -sandbox {SANDBOX_FLAGS}" in out
    assert qemu.sandbox_args() == ["-sandbox", SANDBOX_FLAGS]
    assert f"privilege drop: VMs run as {jail.VM_USER}" in out
    assert "cgroup v2: one per VM with cpu, memory and pids limits" in out

    (tmp_path / "cgroup.controllers").write_text("cpu io\n")  # v2 without the memory and pids controllers
    cli.cmd_doctor(argparse.Namespace(selftest=False, config=tmp_path / "service.yml"))
    assert "NO  a cgroup hierarchy (v2 or v1) with the cpu, memory and pids controllers" in capsys.readouterr().out


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


def test_restored_qemu_inherits_no_environment_cwd_or_capability_bound_from_the_service(make_engine, monkeypatch):
    # What a service carries in its environment: an escaped guest must not read it in its own /proc.
    monkeypatch.setenv("GITHUB_TOKEN", "ghs_secret")
    monkeypatch.setenv("MICROVM_CHECK_APP_KEY", "/etc/microvm-check/app.pem")
    engine = make_engine(pool_size=0)
    vm = engine.create(VMRequest())
    pid = vm.machine.pid
    assert _environ(pid) == {}
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    assert _status(pid)["CapBnd"] == "0000000000000000"
    assert _status(pid)["THP_enabled"] == "0"  # jail.confine: no huge pages for TCG's buffer (memory per VM)
    engine.destroy(vm)

def test_restored_qemu_cannot_open_connections_on_the_hosts_network(make_engine):
    """QEMU's own sockets (not the guest's, which go through the filtered tap) reach nothing: a
    chardev that connects out stands in for code an escaped guest runs in the VMM."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    engine = make_engine(pool_size=0)
    vm = engine.create(VMRequest())
    try:
        assert os.readlink(f"/proc/{vm.machine.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        with pytest.raises(VMError, match="QMP chardev-add failed"):
            vm.machine.qmp("chardev-add", id="escape", backend={"type": "socket", "data": {
                "addr": {"type": "inet", "data": {"host": "127.0.0.1", "port": str(port)}}, "server": False}})
        with pytest.raises(socket.timeout, match="^timed out$"):
            listener.accept()
    finally:
        listener.close()
        engine.destroy(vm)




SERVICE_DYING_DURING_SPAWN = """
import os, signal, subprocess, sys, time
from runner.vm import jail
setup = jail.confine(None)
def service_dies_first():  # the worst moment: after the fork, before the signal is armed
    service = os.getppid()
    os.kill(service, signal.SIGKILL)
    while os.getppid() == service:
        time.sleep(0.001)
    setup()
subprocess.Popen(["/bin/sh", "-c", "echo started > " + sys.argv[1]], preexec_fn=service_dies_first)
"""


def test_a_vmm_whose_service_dies_before_the_parent_death_signal_is_armed_never_starts(need_root, tmp_path):
    marker = tmp_path / "vmm-started"
    service = subprocess.Popen([sys.executable, "-c", SERVICE_DYING_DURING_SPAWN, str(marker)],
                               cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE)
    service.stdout.read()  # EOF: every holder of the pipe, the orphaned child included, has exited
    assert service.wait() == -signal.SIGKILL
    assert not marker.exists(), "the VMM ran on although its service died before the death signal was armed"
def _fd_of(pid: int, suffix: str) -> int:
    return next(int(fd) for fd in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{fd}").endswith(suffix))


def test_one_vms_qemu_cannot_reach_another_vms_qemu(make_engine):
    """Every VMM has a uid of its own: one cannot signal, trace or open the files of another (here:
    VM a's QEMU asked to open VM b's writable disk overlay through /proc/<b>/fd)."""
    engine = make_engine(pool_size=0)
    a = engine.create(VMRequest())
    b = engine.create(VMRequest())
    try:
        assert _status(a.machine.pid)["Uid"] != _status(b.machine.pid)["Uid"]
        overlay = f"/proc/{b.machine.pid}/fd/{_fd_of(b.machine.pid, 'disk.qcow2')}"
        with pytest.raises(VMError, match="QMP blockdev-add failed.*(Permission denied|Operation not permitted)"):
            a.machine.qmp("blockdev-add", driver="file", filename=overlay, **{"node-name": "theirs"})
    finally:
        engine.destroy(a)
        engine.destroy(b)
    assert a.machine.exit_status() is not None and b.machine.exit_status() is not None
    assert a.machine.lease.uid != b.machine.lease.uid


def _lease_is_held(uid: int) -> bool:
    fd = os.open(jail.UID_LEASES / str(uid), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_vm_uid_is_leased_once_across_engines_and_free_again_when_released(need_root):
    first = jail.lease_uid()
    second = jail.lease_uid()  # as another engine, in this or another process, would
    try:
        assert first.uid != second.uid and {first.uid, second.uid} <= set(jail.VM_UIDS)
        assert _lease_is_held(first.uid)
        first.close()
        assert not _lease_is_held(first.uid)
    finally:
        first.close()
        second.close()


def test_a_vmm_cannot_write_files_larger_than_its_disk(need_root, tmp_path):
    """A VMM writes through its stderr and its overlay: bounded by RLIMIT_FSIZE, not by the host's disk."""
    target = tmp_path / "out"
    proc = subprocess.run(["/bin/sh", "-c", f"exec head -c 8192 /dev/zero > {target}"],
                          preexec_fn=jail.confine(None, max_file_bytes=4096))
    assert proc.returncode == -signal.SIGXFSZ and target.stat().st_size == 4096


def test_restored_qemu_file_size_limit_is_its_disk_plus_metadata(make_engine):
    engine = make_engine(pool_size=0)
    vm = engine.create(VMRequest())
    limits = Path(f"/proc/{vm.machine.pid}/limits").read_text().splitlines()
    soft, hard = next(line for line in limits if line.startswith("Max file size")).split()[3:5]
    assert int(soft) == int(hard) == vm.snapshot.disk.stat().st_size + jail.FILE_SIZE_SLACK
    engine.destroy(vm)


NAMESPACE_ESCAPES = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD, SYS_CLONE = 0x10000000, 0x40000000, 17, 56
pid = libc.syscall(SYS_CLONE, CLONE_NEWUSER | CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
results = {"clone": pid > 0, "unshare": libc.unshare(CLONE_NEWUSER) == 0}
print(results)
"""


def test_a_confined_vmm_cannot_enter_or_create_namespaces(need_root):
    """User namespaces are how an unprivileged process gets CAP_NET_ADMIN & co. over a fresh
    namespace, the usual way into the kernel's nf_tables and friends; QEMU's -sandbox lets unshare
    and namespace-creating clones through, so the jail adds a filter of its own."""
    lease = jail.lease_uid()
    try:
        user = jail.VMUser(jail.VM_USER, lease.uid, jail.vm_user().gid)
        # the system's Python: the VM's uid cannot read root's home, where this one may live
        proc = subprocess.run(["/usr/bin/python3", "-I", "-c", NAMESPACE_ESCAPES], preexec_fn=jail.confine(user),
                              capture_output=True, text=True, cwd="/")
    finally:
        lease.close()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str({"clone": False, "unshare": False})
