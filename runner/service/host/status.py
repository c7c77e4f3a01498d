"""What the host shows of itself, built for ServiceHost (runner/service/host/assembly.py): the service's metrics
(served on the API's TCP listener) and the status `microvm-check status` prints (GET /v1/status).

The fleet and the webhook are built after the metrics, so both are read through getters at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from runner.jobapi.contract import ACTIVE_STATES
from runner.service.api.metrics import EventsTee, JobMetrics, ServiceView
from runner.service.config.settings import ServiceConfig

if TYPE_CHECKING:
    from runner.fleet.fleet import RunnerFleet
    from runner.service.github.webhook import Webhook
    from runner.service.jobs.service import JobService
    from runner.vm.engine import Engine


def job_metrics(config: ServiceConfig, service: JobService, engine: Engine | None, pool_size: int,
                fleet: Callable[[], RunnerFleet | None], webhook: Callable[[], Webhook | None]) -> JobMetrics:
    """This service's metrics: each job's end as its record is saved, the rest read from the service, the
    engine and the fleet at scrape time."""
    metrics = JobMetrics()
    service.records.events = EventsTee(service.records.events, metrics)

    def deliveries() -> dict[tuple[str, str], int]:
        """The webhook's answered requests; none while it is off."""
        listener = webhook()
        return listener.server.delivery_counts() if listener is not None else {}

    metrics.watch(ServiceView(
        active_jobs=lambda: list(service.records.in_states(ACTIVE_STATES)),
        queued=lambda: service.queue.counts()[0], prewarmed=service.prewarmed.count,
        prewarm_max=config.prewarm.max_vms,
        live_vms=(lambda: len(engine.live()) + sum(engine.pool.ready().values()) + engine.standby_vmms())
        if engine is not None else None,
        spare_vms=(lambda: sum(engine.pool.ready().values())) if engine is not None else None,
        spare_pool_size=pool_size if engine is not None else None,
        runners=lambda: running.runners() if (running := fleet()) is not None else [],
        runner_failed_starts=lambda: ((failed := running.failed_starts).total, failed.in_a_row)
        if (running := fleet()) is not None else (0, 0),
        protocol_errors=(lambda: engine.protocol_errors) if engine is not None else None,
        webhook_deliveries=deliveries))
    return metrics


def beside_runners(service: JobService, engine: Engine | None) -> dict[str, object]:
    """The VMs and the queue, for `microvm-check status` beside the runners."""
    vms = [{"id": vm.id, "ready_ms": round(vm.ready_ms, 1)} for vm in engine.live()] if engine else []
    return {"vms": vms, "queue": service.health().to_wire()}


def host_status(service: JobService, engine: Engine | None, pool_size: int, fleet: RunnerFleet | None,
                listening: dict[str, str | None], recent: int = 10) -> dict[str, object]:
    """What `microvm-check status` shows (GET /v1/status, operators only): the VMs, each with the job it
    runs, the spare pools, the queue, the newest job records, the runners when there is a fleet, and the
    TCP addresses the service listens on (`listening`: the ports it bound, also when the config said 0)."""
    active = {r.vm_id: r.id for r in service.records.in_states(ACTIVE_STATES) if r.vm_id}
    vms = [{"id": vm.id, "ready_ms": round(vm.ready_ms, 1), "job": active.get(vm.id)}
           for vm in engine.live()] if engine else []
    pools = {"size": pool_size, "ready": engine.pool.ready()} if engine else None
    shown = fleet.status() if fleet is not None else None
    if shown is not None:
        for key in ("vms", "queue"):
            shown.pop(key, None)
    return {"vms": vms, "spare_pools": pools, "queue": service.health().to_wire(),
            "recent_jobs": [r.to_wire() for r in service.list(recent)], "fleet": shown, "listening": listening}
