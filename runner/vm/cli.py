"""`microvm-check doctor`: what this host has, what it lacks, and which accelerator VMs will use."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass

from runner.vm import accel, cgroup, jail
from runner.vm.errors import VMError
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateNotFound, TemplateStore


@dataclass(frozen=True)
class Check:
    ok: bool
    what: str
    fix: str = ""


def register(subparsers) -> None:
    doctor = subparsers.add_parser("doctor", help="check this host and say which accelerator VMs use")
    doctor.add_argument("--selftest", action="store_true", help="also test-boot the guest kernel under KVM")
    doctor.set_defaults(func=cmd_doctor)


def host_checks() -> list[Check]:
    tools = {
        "qemu-system-x86_64": "apt-get install qemu-system-x86",
        "qemu-img": "apt-get install qemu-utils",
        "debootstrap": "apt-get install debootstrap",
        "iptables-restore": "apt-get install iptables",
        "ip": "apt-get install iproute2",
        "/bin/busybox": "apt-get install busybox-static",
    }
    checks = [Check(os.geteuid() == 0, "running as root", "VMs, namespaces and templates need root: use sudo")]
    for tool, fix in tools.items():
        found = os.path.exists(tool) if tool.startswith("/") else shutil.which(tool) is not None
        checks.append(Check(found, f"{tool} is installed", fix))
    checks.append(Check(os.path.exists("/dev/net/tun"), "/dev/net/tun exists", "load the tun module (modprobe tun)"))
    return checks


def confinement_checks() -> list[Check]:
    """What confines a restored VM's QEMU: seccomp, the unprivileged user, the parent-death tie, cgroups."""
    qemu = shutil.which("qemu-system-x86_64")
    seccomp = qemu is not None and _qemu_has_sandbox(qemu)
    checks = [Check(seccomp, f"QEMU seccomp sandbox: -sandbox {jail.SANDBOX}",
                    "install a QEMU built with seccomp (Debian's qemu-system-x86 is)")]
    try:
        entry = pwd.getpwnam(jail.VM_USER)
        checks.append(Check(entry.pw_gid != 0, f"privilege drop: VMs run as {jail.VM_USER} (group {entry.pw_gid}), "
                            "files handed over as descriptors, template RAM a sealed memfd"))
    except KeyError:
        checks.append(Check(True, f"privilege drop: VMs run as {jail.VM_USER}, created on first use "
                            "(or by scripts/setup)"))
    taken = jail.taken_vm_uids()
    checks.append(Check(not taken, f"each VM has a uid of its own ({jail.VM_UIDS.start}-{jail.VM_UIDS.stop - 1})"
                        + (f": taken by {', '.join(taken[:5])}" if taken else ""),
                        "move those accounts out of that range: a VMM would share their uid"))
    checks.append(Check(os.path.exists("/proc/self/ns/net"),
                        "network namespaces: each VMM runs in an empty one; a parent-death signal ends it with the service",
                        "use a kernel with network namespaces (CONFIG_NET_NS)"))
    version = cgroup.version()
    what = f"cgroup {version}: one per VM with cpu, memory and pids limits" if version else \
        "a cgroup hierarchy (v2 or v1) with the cpu, memory and pids controllers"
    checks.append(Check(version is not None, what,
                        "mount cgroup v2 at /sys/fs/cgroup, or v1's cpu, memory and pids hierarchies"))
    return checks


def _qemu_has_sandbox(qemu: str) -> bool:
    """QEMU lists -sandbox in its help only when it was built with seccomp."""
    try:
        out = subprocess.run([qemu, "-help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "-sandbox" in out


def template_check(state: StateDir) -> Check:
    try:
        template = TemplateStore(state.templates).get("base")
    except TemplateNotFound as exc:
        return Check(False, "template 'base' is built", str(exc))
    m = template.manifest
    return Check(True, f"template 'base' is built ({template.digest}, {m['accel']}, {m['memory_mib']} MiB)")


def cmd_doctor(args) -> int:
    state = StateDir.default()
    checks = [*host_checks(), *confinement_checks(), template_check(state)]
    for check in checks:
        line = f"{'ok ' if check.ok else 'NO '} {check.what}"
        print(line if check.ok else f"{line}: {check.fix}")
    verdict = accel.static_checks()
    if verdict is None and args.selftest:
        from runner.vm.qemu import qemu_binary

        try:
            template = TemplateStore(state.templates).get("base")
            qemu = qemu_binary()
        except (TemplateNotFound, VMError) as exc:
            print(f"accelerator: cannot test-boot the guest: {exc}")
            return 1
        verdict = accel.detect(qemu, template.path / "vmlinuz", template.path / "initrd.img")
    if verdict is None:
        print("accelerator: KVM looks usable; 'doctor --selftest' test-boots the guest to be sure "
              "(template build does this before choosing)")
    else:
        print(f"accelerator: {verdict.name} ({verdict.reason})")
    return 0 if all(c.ok for c in checks) else 1
