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
warm bases (runner/service/jobs/bases.py) on its engine, held to the config's `bases.disk_budget` from
the start (a budget lowered since the last run evicts at once) and after every build.

`_build` is the order; each role's parts are built by its own builder: the VM side (host/vms.py), the
job side (host/jobs.py), the GitHub side (host/github.py), the fleet (host/fleet.py), and the metrics
and status (host/status.py).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack
from typing import TYPE_CHECKING

from runner.service.host import fleet as host_fleet, github as host_github, jobs as host_jobs, status as host_status
from runner.service.config.settings import ServiceConfig
from runner.service.host.vms import EngineSettings, VMSide, start_sandboxes, start_vms
from runner.service.api.listeners import ApiServers

if TYPE_CHECKING:
    from runner.fleet.fleet import RunnerFleet
    from runner.sandbox.port import SandboxFactory
    from runner.service.jobs.egress import EgressPolicies
    from runner.service.jobs.service import JobService
    from runner.service.github.webhook import Webhook

__all__ = ["EngineSettings", "ServiceHost"]


class ServiceHost:
    """The job service and everything it runs on, built in `__enter__` and closed in `close()`.

    `sandboxes` replaces the engine (and the network slots) with a stand-in, for tests of the
    service above the VM layer; `serve_api=False` leaves out the API servers, for tests that drive
    the `JobService` directly. `origin` (the config file) prefixes errors a user must fix there.

    Once built it holds: `engine` (None with a stand-in) and `vms` (its slots and provider), `service`
    (the job API), `retention`, `desk` (the runners, their bindings and the fork guard), `reactions`
    (what the webhook's deliveries do), `metrics`, `sandboxes` (the interactive ones), `api` (None
    without `serve_api`), `fleet` and `webhook` (None unless configured).
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
        # read by the metrics at scrape time, which may come before these are built
        self.fleet: RunnerFleet | None = None
        self.webhook: Webhook | None = None
        self._stack = ExitStack()

    def __enter__(self) -> ServiceHost:
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
        config, stack, origin, settings = self.config, self._stack, self._origin, self._engine_settings
        self.vms: VMSide | None = None
        if self._sandboxes is not None:
            create = self._sandboxes
        else:
            self.vms = start_vms(config, settings, stack, origin)
            create = self.vms.provider.create
        self.engine = self.vms.engine if self.vms is not None else None
        provider = self.vms.provider if self.vms is not None else None
        host_fleet.sweep_runner_scope(config)
        service = self.service = host_jobs.start_service(
            config, lambda policies: host_github.job_vms(config, create, provider, policies, stack),
            self._policies, stack, origin)
        self.retention = host_jobs.start_retention(service, stack)
        self.desk, self.reactions = host_github.runner_desk(config, service)
        self.metrics = host_status.job_metrics(config, service, self.engine, settings.pool_size,
                                               lambda: self.fleet, lambda: self.webhook)
        self.sandboxes = start_sandboxes(config, service, create, provider, stack)
        self.api = self._serve(service) if self._serve_api else None
        if config.runners.org is not None:
            self.fleet = host_fleet.start_fleet(config, self.desk, self.metrics,
                                                lambda: host_status.beside_runners(service, self.engine), stack, origin)
        self.webhook = host_github.webhook(config, self.reactions, self.fleet, stack, origin)

    def _serve(self, service: JobService) -> ApiServers:
        """The API servers, serving: they bind the sockets (closing what they bound if one fails). At
        close the sandboxes end first (an exec in flight returns, so the servers wait on no VM), then the
        service drains while the API still serves, so clients see their jobs end, then the servers close."""
        api = ApiServers(service, self.desk, metrics=self.metrics,
                         host_status=functools.partial(self.status, service), sandboxes=self.sandboxes)
        self._stack.callback(api.close)
        self._stack.callback(service.drain)  # runs before api.close: clients see their jobs end
        self._stack.callback(self.sandboxes.close)  # first: an exec in flight returns, so api.close waits on no VM
        api.start()
        return api

    def status(self, service: JobService, recent: int = 10) -> dict[str, object]:
        """What `microvm-check status` shows (GET /v1/status, operators only): host_status.host_status."""
        return host_status.host_status(service, self.engine, self._engine_settings.pool_size, self.fleet,
                                       self.listening(), recent)

    def listening(self) -> dict[str, str | None]:
        """The TCP addresses bound, by listener: the job API's (`listen`) and the webhook's (`webhook.listen`),
        with the port the kernel chose where the config said 0; None for a listener not configured."""
        tcp = self.api.tcp_address if self.api is not None else None
        api = f"{self.config.listen[0]}:{tcp[1]}" if tcp is not None and self.config.listen else None
        hook = self.config.webhook.listen
        webhook = f"{hook[0]}:{self.webhook.port}" if self.webhook is not None and hook else None
        return {"api": api, "webhook": webhook}
