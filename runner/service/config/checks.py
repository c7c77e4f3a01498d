"""The checks of the service's configuration that no one setting can make alone: settings that need or
exclude each other (token with listen, runners with the App settings), what needs the host to answer
(the token file, the sandbox group's members, the host's memory for the size classes).

They run after the walk (reading.py) has read every setting, and report each problem at the line of
the setting it names, so an operator fixes the file in one go.
"""

from __future__ import annotations

import grp
import pwd
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from policy.yamldoc import quote
from runner.service.config.settings import ServiceConfig, WebhookSettings

MAX_TOKEN_FILE = 4096
HOST_RESERVE_MIB = 1024  # of the host's memory, kept for the service, the kernel and the runners' own steps


class Report(Protocol):
    """Where a check's problems go: the walk that read the file (reading.Walk), which knows each setting's
    line; the checks need no more of it."""

    def at(self, where: str, message: str) -> None:
        """A problem with the setting at dotted path `where`."""


def check_config(config: ServiceConfig, report: Report) -> ServiceConfig:
    """What one setting alone cannot say: settings that need or exclude each other, the token file.
    The config with the token read from token_file, when it names one."""
    token = config.token
    if config.token and config.token_file:
        report.at("token", "set either token or token_file, not both")
    elif config.token_file:
        token = _read_token(config.token_file, report)
    if config.listen and (not token or len(token) < 16):
        report.at("listen", "TCP needs a bearer token of at least 16 characters (token or token_file)")
    if config.default_timeout_seconds > config.max_timeout_seconds:
        report.at("default_timeout_seconds", f"larger than max_timeout_seconds ({config.max_timeout_seconds})")
    if config.network.allow.rules and not config.network.enabled:
        report.at("network.allow", "has no effect while network.enabled is false; enable networking or remove allow")
    check_webhook(config.webhook, report, "webhook.")
    _check_runners(config, report)
    _check_sandbox_group(config, report)
    _check_sizes_fit(config, report)
    return replace(config, token=token)


def check_webhook(settings: WebhookSettings, report: Report, prefix: str) -> None:
    """A webhook endpoint needs its secret: a `webhook:` section alone (webhook_from_mapping) is checked too."""
    if settings.listen and not settings.secret_path:
        report.at(prefix + "listen", f"{prefix}secret_path: required when listen is set "
                                     "(a file holding the webhook secret)")


def _check_runners(config: ServiceConfig, report: Report) -> None:
    runners = config.runners
    if runners.org is None:
        return
    if runners.runner_user == "root":
        report.at("runners.runner_user", "runners never run as root: name an unprivileged user of their own")
    if runners.github_config is None and config.github_config is None:
        report.at("runners.org", "registering runners needs the GitHub App settings: set runners.github_config "
                                 "or github_config")
    most = runners.max_runners or config.max_concurrent_jobs
    if runners.min_idle > most:
        report.at("runners.min_idle", f"larger than max_runners ({most}): at most that many runners exist at once")


def _check_sandbox_group(config: ServiceConfig, report: Report) -> None:
    """Sandboxes' creators are never the socket's users at large nor the fleet's runner user: a runner runs
    a fork's own steps on the host, and a sandbox outlives the job with the sandboxes' repository's egress."""
    group = config.sandboxes.group
    if group is None:
        return
    if group == config.socket_group:
        report.at("sandboxes.group", f"is socket_group ({quote(group)}), which the runners' user is in (docs/fleet.md): "
                                     "name a group of the sandbox callers (a bot's user) alone")
        return
    if config.runners.org is None:
        return
    user = config.runners.runner_user
    try:
        members = grp.getgrnam(group)
    except KeyError:
        return  # no such group yet: nobody is in it
    try:
        primary = pwd.getpwnam(user).pw_gid
    except KeyError:
        primary = None
    if user in members.gr_mem or primary == members.gr_gid:
        report.at("sandboxes.group", f"group {quote(group)} holds the runners' user {quote(user)} (runners.runner_user): "
                                     "a fork's workflow step could create sandboxes; take the user out of the group")


def _check_sizes_fit(config: ServiceConfig, report: Report) -> None:
    """max_concurrent_jobs VMs of the largest size class, each at its cgroup's memory limit (the guest's
    RAM plus QEMU's own, runner/vm/cgroup.py), must fit in this host's memory less a reserve: a class
    that cannot run as many jobs at once as the config admits is refused here, not found by the OOM killer."""
    if not config.sizes:
        return
    from runner.vm.cgroup import limits_for
    from runner.vm.memory import host_memory_mib

    host = host_memory_mib()
    if host is None:
        return
    name, largest = max(config.sizes.items(), key=lambda item: item[1].memory_mib)
    per_vm = limits_for(largest.vcpus, largest.memory_mib).memory_bytes >> 20
    need = config.max_concurrent_jobs * per_vm
    if need > host - HOST_RESERVE_MIB:
        most = max(0, (host - HOST_RESERVE_MIB) // per_vm)
        report.at(f"sizes.{name}", f"max_concurrent_jobs ({config.max_concurrent_jobs}) VMs of this size need "
                                   f"{need} MiB ({per_vm} MiB each: memory_mib plus QEMU's own), more than this host's "
                                   f"{host} MiB less {HOST_RESERVE_MIB} MiB for the host: lower memory_mib, or "
                                   f"max_concurrent_jobs to {most} or fewer")


def _read_token(path: Path, report: Report) -> str | None:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        report.at("token_file", f"cannot read {quote(str(path), 200)}: {exc.strerror}")
        return None
    if len(data) > MAX_TOKEN_FILE:
        report.at("token_file", f"{quote(str(path), 200)} is larger than {MAX_TOKEN_FILE} bytes; it should hold one token")
        return None
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        report.at("token_file", f"{quote(str(path), 200)} is not ASCII text")
        return None
