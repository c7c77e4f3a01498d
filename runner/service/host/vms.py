"""The host's VM side, built for ServiceHost (runner/service/host/assembly.py): the network slots, the VM engine
on them, and what runs on the engine beside the jobs (the interactive sandboxes).

The VM and network layers need root and QEMU: they are imported only when built, so a host given a
stand-in sandbox factory (tests of the service above the VM layer) never loads them.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.errors import ConfigError, MicrovmCheckError, SandboxError
from runner.service.config.settings import ServiceConfig
from runner.vm.statedir import StateDir

if TYPE_CHECKING:
    from runner.net import SlotPool, Upstream
    from runner.net.uplink import Uplink
    from runner.sandbox.port import SandboxFactory
    from runner.sandbox.sandbox import EngineSandboxes
    from runner.service.jobs.sandboxes import SandboxDesk
    from runner.service.jobs.service import JobService
    from runner.vm.engine import Engine
    from runner.vm.templates import TemplateStore


@dataclass(frozen=True)
class EngineSettings:
    """Where the host's VM engine lives; the defaults are what `serve` runs on."""

    state: StateDir | None = None  # its VM directory's root; default: the service's state_dir
    templates: TemplateStore | None = None  # default: the templates under `state`
    pool_size: int = 2  # restored, never-used VMs kept ready per snapshot
    uplink: Uplink | None = None  # for network.enabled; default: NAT out of the host's uplink interface
    upstream: Upstream | None = None  # where the guests' resolver asks allowed names; default: resolv.conf's


@dataclass(frozen=True)
class VMSide:
    """The engine and its slots, and the engine as the service sees it (its `SandboxProvider`)."""

    slots: SlotPool | None
    engine: Engine
    provider: EngineSandboxes


def start_vms(config: ServiceConfig, settings: EngineSettings, stack: ExitStack, origin: str | None) -> VMSide:
    """The VM engine, networked when the config says so; it sweeps a crashed predecessor's VMs (and
    the slot pool its namespaces) as it starts, not at the first job."""
    from runner.sandbox.sandbox import EngineSandboxes
    from runner.vm.engine import Engine

    state = settings.state or StateDir(config.state_dir)
    slots = None
    try:
        if config.network.enabled:
            slots = _slot_pool(config, settings.uplink, settings.upstream)
            stack.callback(slots.close)
            slots.start()
        engine = Engine(state, templates=settings.templates, pool_size=settings.pool_size, net=slots)
    except (MicrovmCheckError, OSError) as exc:  # anything else is a bug: its traceback must show
        raise SandboxError(f"the VM engine could not start on {state.root}: {exc}") from exc
    stack.callback(engine.close)
    _require_templates(config, engine, origin)
    return VMSide(slots, engine, EngineSandboxes(engine))


def _require_templates(config: ServiceConfig, engine: Engine, origin: str | None) -> None:
    """Every template the config offers is built, with a guest agent that serves what this host sends, or
    the host does not start: otherwise each job fails with "no template" (or "baked with an older agent")
    while the service looks healthy. The error names the command that fixes it."""
    from runner.vm.templates import TemplateNotFound, sized, stale_agent

    missing, stale = [], []
    # a size class's template (`<name>.<size>`) is built on demand, so only one that exists is checked
    at_sizes = [sized(name, size) for name in config.templates for size in config.sizes or {}]
    for name in (*config.templates, *at_sizes):
        try:
            problem = stale_agent(engine.templates.get(name), config=origin or None)
        except TemplateNotFound:
            if name in config.templates:
                missing.append(name)
            continue
        if problem is not None:
            stale.append(problem)
    if stale:
        raise ConfigError(f"{origin + ': ' if origin else ''}{'; '.join(stale)}")
    if missing:
        where = f"{origin}: " if origin else ""
        flag = f" --config {origin}" if origin else ""
        commands = "; ".join(f"sudo microvm-check template build {name}{flag}" for name in missing)
        raise ConfigError(f"{where}templates: {', '.join(map(repr, missing))} not built in "
                          f"{engine.templates.root}; build {'it' if len(missing) == 1 else 'them'}: {commands}")


def _slot_pool(config: ServiceConfig, uplink: Uplink | None, upstream: Upstream | None) -> SlotPool:
    from policy.blocklist import EMPTY, BlockListError, load_block_list
    from runner.net import HostUplink, SlotPool

    network = config.network
    try:
        block_list = load_block_list(network.block_list) if network.block_list is not None else EMPTY
    except BlockListError as exc:
        raise ConfigError(f"network.block_list: {exc}") from None
    return SlotPool(network.slot_prefix, uplink or HostUplink(out_iface=network.uplink_interface),
                    size=network.slots, allowances=network.allow, upstream=upstream, block_list=block_list,
                    upstream_ca=str(network.upstream_ca) if network.upstream_ca is not None else None)


def start_sandboxes(config: ServiceConfig, service: JobService, create: SandboxFactory,
                    provider: EngineSandboxes | None, stack: ExitStack) -> SandboxDesk:
    """The interactive sandboxes (runner/service/jobs/sandboxes.py) on the jobs' VM factory, saved as job
    records; snapshots (forks) only on a real engine, whose templates they become."""
    from runner.service.jobs.sandboxes import SandboxDesk

    desk = SandboxDesk(config, create, service.policies, service.records.put,
                       provider.remove if provider is not None else None)
    stack.callback(desk.close)  # before service.close: the records are written as the sandboxes end
    desk.start(provider.sandbox_snapshots() if provider is not None else ())
    return desk
