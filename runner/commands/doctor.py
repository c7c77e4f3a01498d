"""`microvm-check doctor`: what this host has, what it lacks, and which accelerator VMs will use."""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from runner.vm import accel, cgroup, jail, memory
from runner.vm.errors import VMError
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateNotFound, TemplateStore, sized, stale_agent

if TYPE_CHECKING:
    from runner.service.config.settings import ServiceConfig


@dataclass(frozen=True)
class Check:
    ok: bool
    what: str
    fix: str = ""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = subparsers.add_parser("doctor", help="check this host and say which accelerator VMs use")
    doctor.add_argument("--selftest", action="store_true", help="also test-boot the guest kernel under KVM")
    doctor.add_argument("--config", type=Path, default=DEFAULT_SERVICE_CONFIG,
                        help=f"the service config to check, with its socket (default {DEFAULT_SERVICE_CONFIG})")
    doctor.set_defaults(func=cmd_doctor)


def host_checks() -> list[Check]:
    tools = {
        "qemu-system-x86_64": "apt-get install qemu-system-x86",
        "qemu-img": "apt-get install qemu-utils",
        "debootstrap": "apt-get install debootstrap",
        "iptables-restore": "apt-get install iptables",
        "ip": "apt-get install iproute2",
        "/bin/busybox": "apt-get install busybox-static",
        "skopeo": "apt-get install skopeo (image templates: docs/images.md)",
        "zstd": "apt-get install zstd (image templates' zstd layers)",
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


def runner_walls(network: str) -> list[str]:
    """The walls between the fleet's runners on this host (runner/fleet/walls.py): for the operator to
    read, not checks (a wall this host lacks is said so, with what it means)."""
    from runner.fleet import walls

    return [f"runner wall {'on ' if on else 'OFF'} {name}: {why}" for name, on, why in walls.in_force(network)]


def runner_path_checks(config: ServiceConfig) -> list[Check]:
    """With a fleet: whether its runners can see what they run (the release, their directories, the socket,
    this installation), none of it under a place the walls give each runner an empty tmpfs of."""
    from runner.fleet import walls

    if config.runners.org is None:
        return []
    runners = config.runners
    hidden = walls.hidden(walls.runner_paths(runners.install_dir, runners.runners_dir, config.socket))
    return [Check(not hidden, "the runners see what they run: this installation, install_dir, runners_dir and the "
                  "socket lie outside " + ", ".join(where for where, _ in walls.PRIVATE_TMPFS)
                  + " and below directories every user may enter",
                  "; ".join(hidden) + f": put them elsewhere ({walls.WHERE_INSTEAD})")]


def _qemu_has_sandbox(qemu: str) -> bool:
    """QEMU lists -sandbox in its help only when it was built with seccomp."""
    try:
        out = subprocess.run([qemu, "-help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "-sandbox" in out


DEFAULT_SERVICE_CONFIG = Path("/etc/microvm-check/service.yml")
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# What the audit-mode rules need (policy.render): iptables with the NFLOG target. Tested, never committed.
NFLOG_PROBE = "*filter\n:MVC-DOCTOR - [0:0]\n-A MVC-DOCTOR -j NFLOG --nflog-group 100\nCOMMIT\n"


def network_checks(forward: Path = IP_FORWARD) -> list[Check]:
    """What networked VMs need of the host: forwarding (the service turns it on) and iptables with NFLOG."""
    try:
        on = forward.read_text().strip() == "1"
    except OSError:
        on = False
    if on:
        checks = [Check(True, "IP forwarding is on")]
    else:
        checks = [Check(os.access(forward, os.W_OK), "IP forwarding is off; the service turns it on when "
                        "network.enabled is true", f"make {forward} writable (run as root, not in a read-only /proc)")]
    try:
        done = subprocess.run(["iptables-restore", "--wait", "--test", "--noflush"], input=NFLOG_PROBE, capture_output=True,
                              text=True, timeout=10)
        error = done.stderr.strip().splitlines()[-1] if done.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as exc:
        error = str(exc)
    checks.append(Check(not error, "iptables loads rules with the NFLOG target (audit mode)",
                        f"{error}; install iptables and use a kernel with nfnetlink_log"))
    return checks


def service_checks(path: Path) -> list[Check]:
    """The service config (the loader `config check` runs) and the job API socket it names."""
    return load_service_config(path)[1]


def load_service_config(path: Path) -> tuple[ServiceConfig | None, list[Check]]:
    """The config at `path` (None when it is missing or invalid) and what doctor says about it and its socket."""
    from runner.service.config.reading import ConfigError, load_config

    if not path.exists():
        return None, [Check(False, f"service config {path} exists",
                            "write one (README: 'Install on a runner host') or name it with --config FILE")]
    try:
        config = load_config(path)
    except ConfigError as exc:
        return None, [Check(False, f"service config {path} is valid",
                            f"{len(exc.problems) or 1} problem(s), first: {str(exc).splitlines()[0]}; "
                            f"`microvm-check config check {path}` lists them all")]
    return config, [Check(True, f"service config {path} is valid"), *socket_checks(config.socket, config.socket_group)]


def config_file_checks(config: ServiceConfig) -> list[Check]:
    """The files and groups the config names, read as the service will read them: a typo shows here, not at
    the first webhook delivery or the first runner."""
    checks = []
    if config.admin_group is not None:
        checks.append(_group_check("admin_group", config.admin_group, "members are the operator on the socket"))
    if config.webhook.secret_path is not None:
        checks.append(_secret_check("webhook.secret_path", config.webhook.secret_path))
    if config.policy_dir is not None:
        ok = config.policy_dir.is_dir() and os.access(config.policy_dir, os.R_OK | os.X_OK)
        checks.append(Check(ok, f"policy_dir {config.policy_dir} is a readable directory",
                            "create it (see policy/README.md) or fix policy_dir"))
    apps = {("github_config", config.github_config), ("webhook.github_config", config.webhook.github_config),
            ("runners.github_config", config.runners.github_config)}
    for key, path in sorted((k, p) for k, p in apps if p is not None):
        checks.append(github_app_check(key, path))
    return checks


def _group_check(key: str, name: str, why: str) -> Check:
    try:
        grp.getgrnam(name)
        return Check(True, f"{key} {name} exists ({why})")
    except KeyError:
        return Check(False, f"{key} {name} exists", f"create it (groupadd {name}) or fix {key}")


def _secret_check(key: str, path: Path) -> Check:
    try:
        ok = bool(path.read_bytes().strip())
        fix = f"{path} is empty: write the webhook secret into it"
    except OSError as exc:
        ok, fix = False, f"cannot read it: {exc.strerror}"
    return Check(ok, f"{key} {path} is readable and not empty", fix)


def github_app_check(key: str, path: Path) -> Check:
    """The App settings load and their private key signs a JWT (what every call to GitHub starts with)."""
    from runner.github.config import load_settings
    from runner.github.errors import GitHubError

    try:
        settings = load_settings(path)
        settings.app().jwt()
    except GitHubError as exc:
        return Check(False, f"{key} {path}: the GitHub App settings load and the key signs",
                     str(exc).splitlines()[0])
    return Check(True, f"{key} {path}: the GitHub App settings load and the key {settings.private_key_path} signs")


def socket_checks(socket: str, group: str | None) -> list[Check]:
    """The socket's group must exist for the runner to submit; a socket already there must carry it."""
    checks = []
    gid = None
    if group is not None:
        try:
            gid = grp.getgrnam(group).gr_gid
            checks.append(Check(True, f"socket_group {group} exists"))
        except KeyError:
            checks.append(Check(False, f"socket_group {group} exists",
                                f"create it (groupadd {group}) and add the runner's user to it"))
    try:
        info = os.stat(socket)
    except FileNotFoundError:
        return [*checks, Check(True, f"job API socket {socket}: not there yet; `serve` creates it")]
    except OSError as exc:
        return [*checks, Check(False, f"job API socket {socket} can be looked at", exc.strerror or str(exc))]
    if not stat.S_ISSOCK(info.st_mode):
        return [*checks, Check(False, f"job API socket {socket} is a socket", "remove whatever is at that path")]
    if gid is not None and info.st_gid != gid:
        return [*checks, Check(False, f"job API socket {socket} belongs to group {group}",
                               "restart the service, which sets the group at start")]
    return [*checks, Check(True, f"job API socket {socket} is there (mode {stat.S_IMODE(info.st_mode):o})")]


def summary(checks: list[Check]) -> str:
    failed = [c for c in checks if not c.ok]
    if not failed:
        return f"doctor: all {len(checks)} checks passed"
    return f"doctor: {len(checks) - len(failed)} of {len(checks)} checks passed, {len(failed)} to fix (marked NO above)"


def template_check(state: StateDir, name: str = "base") -> Check:
    try:
        template = TemplateStore(state.templates).get(name)
    except TemplateNotFound as exc:
        return Check(False, f"template {name!r} is built in {state.root}", str(exc))
    stale = stale_agent(template)
    if stale is not None:
        return Check(False, f"template {name!r} has a guest agent this host can use", stale)
    m = template.manifest
    image = m.get("image")
    source = f", image {image.get('ref')} {image.get('manifest_digest')}" if isinstance(image, dict) else ""
    return Check(True, f"template {name!r} is built in {state.root} ({template.digest}, {m['accel']}, "
                      f"{m['memory_mib']} MiB{source})")


def cmd_doctor(args: argparse.Namespace) -> int:
    """With a valid config, its state_dir, its templates and the files it names are what is checked:
    exactly what `serve --config` will use."""
    config, service = load_service_config(args.config)
    state = StateDir(config.state_dir) if config is not None else StateDir.default()
    names = config.templates if config is not None else ("base",)
    # a job may ask any offered template at any offered size: each is a template of its own
    names = (*names, *(sized(t, size) for t in names for size in (config.sizes or {} if config else {})))
    checks = [*host_checks(), *confinement_checks(), *network_checks(), *(template_check(state, n) for n in names),
              *service, *(config_file_checks(config) if config is not None else []),
              *(runner_path_checks(config) if config is not None else [])]
    for check in checks:
        line = f"{'ok ' if check.ok else 'NO '} {check.what}"
        print(line if check.ok else f"{line}: {check.fix}")
    verdict = accel.static_checks()
    if verdict is None and args.selftest:
        from runner.vm.qemu import qemu_binary

        try:
            template = TemplateStore(state.templates).get(names[0])
            qemu = qemu_binary()
        except (TemplateNotFound, VMError) as exc:
            print(f"accelerator: cannot test-boot the guest: {exc}")
            return 1
        verdict = accel.detect(qemu, template.path / "vmlinuz", template.path / "initrd.img")
    for line in runner_walls(config.runners.network if config is not None else "host"):
        print(line)
    if config is not None:
        from runner.service.host.binding import runner_binding

        print("\n".join(runner_binding(config)))
    pss = memory.describe(state.vms)  # the VMs running now in this state directory, KVM and TCG apart
    if verdict is None:
        print("accelerator: KVM looks usable; 'doctor --selftest' test-boots the guest to be sure "
              f"(template build does this before choosing); {pss}")
    else:
        print(f"accelerator: {verdict.name} ({verdict.reason}); {pss}")
    print(summary(checks))
    return 0 if all(c.ok for c in checks) else 1
