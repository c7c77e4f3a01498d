"""The one place that assembles the job service and takes it apart again.

    with ServiceHost(config) as host:      # engine (+ network slots) -> job service -> API -> webhook
        ...                                # host.service, host.api, host.engine, host.webhook

`serve`, the in-process service of `run`, the benchmarks and the tests all build the service here,
so how it starts and stops is written once. Data flows one way: the host builds each layer and
hands it up (the engine to the job service as its sandbox factory, the service to the API servers
and the webhook as their hooks); nothing below looks a piece up in a global.

Every piece is closed with `close()`, in the reverse order of building, also when a later piece
fails to start (then `__enter__` closes what it built and raises). One step sits between: the job
service drains (stops taking jobs, gives running ones the configured `shutdown_grace_seconds`,
cancels the rest and destroys their VMs) while the API still serves, so a client sees its job end;
then the API closes, then the records, then the engine (every VM left, warm ones included), and
last the network slots those VMs used.

With VMs and the GitHub App (github_config), the host also gives the job service the repositories'
warm bases (runner/service/bases.py) on its engine, held to the config's `bases.disk_budget` from
the start (a budget lowered since the last run evicts at once) and after every build.
"""

from __future__ import annotations

import functools
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.errors import ConfigError, MicrovmCheckError, SandboxError
from runner.attest.keys import SigningKey
from runner.fleet import registered
from runner.service.listeners import ApiServers
from runner.service.attestation import JobAttestor
from runner.service.config import ServiceConfig
from runner.service.egress import EgressPolicies
from runner.jobapi.contract import ACTIVE_STATES
from runner.sandbox.port import SandboxFactory
from runner.service.metrics import CountedRunners, EventsTee, JobMetrics, ServiceView
from runner.service.desk import RunnerDesk
from runner.service.github_app import branch_files, check_run_reporter, guard_setup
from runner.service.reactions import GitHubReactions
from runner.service.retention import Retention
from runner.service.service import JobService, access_for
from runner.service.webhook import JobHookListeners, Webhook, start_webhook
from runner.vm.statedir import StateDir

if TYPE_CHECKING:  # the VM and network layers need root and QEMU; they are imported only when built
    from runner.fleet.fleet import RunnerFleet
    from runner.net import SlotPool, Upstream
    from runner.net.uplink import Uplink
    from runner.sandbox.sandbox import EngineSandboxes
    from runner.service.bases import RepositoryBases
    from runner.service.sandboxes import SandboxDesk
    from runner.vm.engine import Engine
    from runner.vm.templates import TemplateStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """Where the host's VM engine lives; the defaults are what `serve` runs on."""

    state: StateDir | None = None  # its VM directory's root; default: the service's state_dir
    templates: TemplateStore | None = None  # default: the templates under `state`
    pool_size: int = 2  # restored, never-used VMs kept ready per snapshot
    uplink: Uplink | None = None  # for network.enabled; default: NAT out of the host's uplink interface
    upstream: Upstream | None = None  # where the guests' resolver asks allowed names; default: resolv.conf's


class ServiceHost:
    """The job service and everything it runs on, built in `__enter__` and closed in `close()`.

    `sandboxes` replaces the engine (and the network slots) with a stand-in, for tests of the
    service above the VM layer; `serve_api=False` leaves out the API servers, for tests that drive
    the `JobService` directly. `origin` (the config file) prefixes errors a user must fix there.
    """

    def __init__(self, config: ServiceConfig, *, engine: EngineSettings | None = None,
                 sandboxes: SandboxFactory | None = None, policies: EgressPolicies | None = None,
                 serve_api: bool = True, origin: str | None = None) -> None:
        if engine is not None and sandboxes is not None:
            raise ValueError("give the host either engine settings or a sandbox factory, not both")
        self.config = config
        self._engine_settings = engine or EngineSettings()
        self._sandboxes = sandboxes
        self._policies = policies
        self._serve_api = serve_api
        self._origin = origin
        self.slots: SlotPool | None = None
        self.engine: Engine | None = None
        self.provider: EngineSandboxes | None = None  # the engine as the service sees it
        self.service: JobService | None = None
        self.desk: RunnerDesk | None = None  # the runners, their bindings and the fork guard
        self.reactions: GitHubReactions | None = None  # what the webhook's deliveries do
        self.retention: Retention | None = None
        self.api: ApiServers | None = None
        self.webhook: Webhook | None = None
        self.fleet: RunnerFleet | None = None
        self.metrics: JobMetrics | None = None
        self.sandboxes: SandboxDesk | None = None
        self._stack = ExitStack()

    def __enter__(self) -> "ServiceHost":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every piece built so far, newest first; a piece that fails to close does not keep the
        older ones open (its error is raised once all have run). Safe to call twice."""
        self._stack.close()

    # -- building, bottom up: each step registers its own close before it can fail half-way ----------

    def _build(self) -> None:
        create = self._sandboxes if self._sandboxes is not None else self._start_engine()
        self._sweep_runner_scope()
        service = self.service = self._start_service(create)
        desk = self.desk = RunnerDesk(service, guard_setup(self.config))
        self.reactions = GitHubReactions(service, desk)
        self.metrics = self._metrics(service)
        sandboxes = self.sandboxes = self._start_sandboxes(service, create)
        if self._serve_api:
            # binds the sockets; closes what it bound if one fails
            api = self.api = ApiServers(service, desk, metrics=self.metrics,
                                        host_status=functools.partial(self.status, service), sandboxes=sandboxes)
            self._stack.callback(api.close)
            self._stack.callback(service.drain)  # runs before api.close: clients see their jobs end
            self._stack.callback(sandboxes.close)  # first: an exec in flight returns, so api.close waits on no VM
            api.start()
        if self.config.runners.org is not None:
            self.fleet = self._start_fleet(service, desk)
        hooks = self.reactions if self.fleet is None else JobHookListeners((self.reactions, self.fleet))
        where = f"{self._origin}: webhook" if self._origin else "webhook"
        self.webhook = start_webhook(self.config.webhook, hooks, where)
        if self.webhook is not None:
            self._stack.callback(self.webhook.close)

    def _start_sandboxes(self, service: JobService, create: SandboxFactory) -> SandboxDesk:
        """The interactive sandboxes (runner/service/sandboxes.py) on the jobs' VM factory, saved as job
        records; snapshots (forks) only on a real engine, whose templates they become."""
        from runner.service.sandboxes import SandboxDesk

        provider = self.provider
        desk = SandboxDesk(self.config, create, service.policies, service.records.put,
                           provider.remove if provider is not None else None)
        self._stack.callback(desk.close)  # before service.close: the records are written as the sandboxes end
        desk.start(provider.sandbox_snapshots() if provider is not None else ())
        return desk

    def _metrics(self, service: JobService) -> JobMetrics:
        """This service's metrics (served on the API's TCP listener): each job's end as its record is saved,
        the rest read from the service, the engine and the fleet at scrape time."""
        metrics = JobMetrics()
        service.records.events = EventsTee(service.records.events, metrics)
        engine, settings = self.engine, self._engine_settings
        metrics.watch(ServiceView(
            active_jobs=lambda: list(service.records.in_states(ACTIVE_STATES)),
            queued=lambda: service.queue.counts()[0], prewarmed=service.prewarmed.count,
            prewarm_max=self.config.prewarm.max_vms,
            live_vms=(lambda: len(engine.live()) + sum(engine.pool.ready().values()) + engine.standby_vmms())
            if engine is not None else None,
            spare_vms=(lambda: sum(engine.pool.ready().values())) if engine is not None else None,
            spare_pool_size=settings.pool_size if engine is not None else None,
            runners=lambda: self.fleet.runners() if self.fleet is not None else [],
            protocol_errors=(lambda: engine.protocol_errors) if engine is not None else None,
            webhook_deliveries=self._webhook_deliveries))
        return metrics

    def _webhook_deliveries(self) -> dict[tuple[str, str], int]:
        """The webhook's answered requests; none while it is off (it starts after the metrics are built)."""
        return self.webhook.server.delivery_counts() if self.webhook is not None else {}

    def _start_engine(self) -> SandboxFactory:
        """The VM engine, networked when the config says so; it sweeps a crashed predecessor's VMs (and
        the slot pool its namespaces) as it starts, not at the first job."""
        from runner.sandbox.sandbox import EngineSandboxes
        from runner.vm.engine import Engine

        settings = self._engine_settings
        state = settings.state or StateDir(self.config.state_dir)
        try:
            if self.config.network.enabled:
                self.slots = self._slot_pool(settings.uplink, settings.upstream)
                self._stack.callback(self.slots.close)
                self.slots.start()
            self.engine = Engine(state, templates=settings.templates, pool_size=settings.pool_size, net=self.slots)
        except (MicrovmCheckError, OSError) as exc:  # anything else is a bug: its traceback must show
            raise SandboxError(f"the VM engine could not start on {state.root}: {exc}") from exc
        self._stack.callback(self.engine.close)
        self._require_templates(self.engine)
        self.provider = EngineSandboxes(self.engine)
        return self.provider.create

    def _require_templates(self, engine: Engine) -> None:
        """Every template the config offers is built, or the host does not start: otherwise each job fails
        with "no template" while the service looks healthy. The error names the command that fixes it."""
        from runner.vm.templates import TemplateNotFound

        missing = []
        for name in self.config.templates:
            try:
                engine.templates.get(name)
            except TemplateNotFound:
                missing.append(name)
        if missing:
            where = f"{self._origin}: " if self._origin else ""
            config = f" --config {self._origin}" if self._origin else ""
            commands = "; ".join(f"sudo microvm-check template build {name}{config}" for name in missing)
            raise ConfigError(f"{where}templates: {', '.join(map(repr, missing))} not built in "
                              f"{engine.templates.root}; build {'it' if len(missing) == 1 else 'them'}: {commands}")

    def _slot_pool(self, uplink: Uplink | None, upstream: Upstream | None) -> SlotPool:
        from runner.net import HostUplink, SlotPool

        from policy.blocklist import EMPTY, BlockListError, load_block_list

        network = self.config.network
        try:
            block_list = load_block_list(network.block_list) if network.block_list is not None else EMPTY
        except BlockListError as exc:
            raise ConfigError(f"network.block_list: {exc}") from None
        return SlotPool(network.slot_prefix, uplink or HostUplink(out_iface=network.uplink_interface),
                        size=network.slots, allowances=network.allow, upstream=upstream, block_list=block_list,
                        upstream_ca=str(network.upstream_ca) if network.upstream_ca is not None else None)

    def _sweep_runner_scope(self) -> None:
        """Kill and remove the runners a dead predecessor of this service left in its cgroup scope, whether or
        not this config starts a fleet (runner/fleet/scope.py). After the engine: its lock makes the state
        directory this service's alone."""
        from runner.fleet.scope import sweep_stale

        swept = sweep_stale(self.config.state_dir)
        if swept:
            log.warning("swept runners a previous service left: %s", ", ".join(swept))

    def _start_fleet(self, service: JobService, desk: RunnerDesk) -> RunnerFleet:
        """The host's ephemeral runners (`runners:`), closed before the service drains: at shutdown busy
        runners finish their jobs while the service still runs them. They hear the webhook too."""
        from runner.fleet.fleet import FleetSettings, RunnerFleet
        from runner.github.config import load_settings
        from runner.github.errors import GitHubError
        from runner.github.runners import RunnerAdmin

        settings = FleetSettings.from_config(self.config)
        where = f"{self._origin}: runners" if self._origin else "runners"
        try:
            github = load_settings(self.config.runners.github_config or self.config.github_config)
            admin = RunnerAdmin(github.app().as_installation, settings.org)
        except GitHubError as exc:
            raise ConfigError(f"{where}: the GitHub App settings: {exc}") from exc
        counted = CountedRunners(desk, self.metrics) if self.metrics is not None else desk
        fleet = RunnerFleet(settings, admin, counted, extra_status=functools.partial(self._status, service))
        desk.on_bound(fleet.runner_bound)  # the fleet marks the runner busy as its hook reports the job
        self._stack.callback(fleet.close)
        try:
            fleet.start()
        except ConfigError as exc:  # no runner user, no installed release
            raise ConfigError(f"{where}: {exc}") from exc
        return fleet

    def _status(self, service: JobService) -> dict[str, object]:
        """The VMs and the queue, for `microvm-check status` beside the runners."""
        vms = [{"id": vm.id, "ready_ms": round(vm.ready_ms, 1)} for vm in self.engine.live()] if self.engine else []
        return {"vms": vms, "queue": service.health().to_wire()}

    def status(self, service: JobService, recent: int = 10) -> dict[str, object]:
        """What `microvm-check status` shows (GET /v1/status, operators only): the VMs, each with the job it
        runs, the spare pools, the queue, the newest job records, and the runners when there is a fleet."""
        active = {r.vm_id: r.id for r in service.records.in_states(ACTIVE_STATES) if r.vm_id}
        vms = [{"id": vm.id, "ready_ms": round(vm.ready_ms, 1), "job": active.get(vm.id)}
               for vm in self.engine.live()] if self.engine else []
        pools = {"size": self._engine_settings.pool_size, "ready": self.engine.pool.ready()} if self.engine else None
        fleet = self.fleet.status() if self.fleet is not None else None
        if fleet is not None:
            for key in ("vms", "queue"):
                fleet.pop(key, None)
        return {"vms": vms, "spare_pools": pools, "queue": service.health().to_wire(),
                "recent_jobs": [r.to_wire() for r in service.list(recent)], "fleet": fleet}

    def _start_service(self, create: SandboxFactory) -> JobService:
        """The job service, started: it fails the jobs a dead predecessor left active and sweeps their
        directories now."""
        try:
            policies = self._policies or EgressPolicies(self.config.policy_dir, branch_files=branch_files(self.config))
            access = access_for(self.config, registered.load(self.config.state_dir))
            attestor = JobAttestor(SigningKey.load_or_create(self.config.attestation_key_path))
            service = JobService(self.config, create, policies, self._warm_bases(policies), access=access,
                                 attestor=attestor, check_runs=check_run_reporter(self.config, attestor.key.keyid))
        except ConfigError as exc:  # e.g. unreadable GitHub App settings
            raise ConfigError(f"{self._origin}: {exc}" if self._origin else str(exc)) from exc
        self._stack.callback(service.close)
        service.start()
        retention = self.retention = Retention(service)
        self._stack.callback(retention.close)
        retention.start()
        return service

    def _warm_bases(self, policies: EgressPolicies) -> RepositoryBases | None:
        """The repositories' warm bases on the engine; None without real VMs or without the App, which
        reads the default branches the bases are built from. Bases snapshot their VMs and keep the spare
        VMs in step with them, so they get the engine as a whole `SandboxProvider`."""
        if self.provider is None or policies.branch_files is None:
            return None
        from policy import PolicyStore
        from runner.service.bases import BaseSettings, RepositoryBases, branch_warm

        source = policies.branch_files
        bases = RepositoryBases(self.provider, branch_warm(PolicyStore(self.config.policy_dir), source), source,
                                BaseSettings.from_config(self.config))
        bases.evict()
        self._stack.callback(bases.close)  # after the service closes, before the engine: no build outlives the host
        return bases
