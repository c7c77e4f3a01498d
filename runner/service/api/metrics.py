"""The service's Prometheus metrics, on a registry of its own (never prometheus_client's global one).

Two sources, so that no hot path grows a hook:
- what the service already holds (jobs by state, queue depth, live VMs, pre-warmed VMs, runners) and
  what its pieces already count (the engine's VMs destroyed for a guest protocol error, the webhook's
  answered deliveries) is read at scrape time by `ServiceCollector`;
- what happens once per job (its end, its VM's ready time, its duration and overhead, the egress it was
  refused) is observed from its final record as it is saved: `JobMetrics.saw` is chained after the
  record store's lifecycle events (`runner.logs.JobEvents`, which already sees every saved record), so
  every path that ends a job (worker, reaper, cancel, start-up clean-up) is counted once.

Counters and histograms start at zero with the process, as Prometheus expects; the job records are the
durable history (a scrape during a job and the records agree: tests/service/api/test_web_metrics.py).
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from runner.jobapi.contract import ACTIVE_STATES, JobState, step_exit_code

if TYPE_CHECKING:
    from policy.suggest import AuditRecord
    from runner.fleet.model import FleetRunner
    from runner.jobapi.contract import JobRecord, JobStarted
    from runner.service.github.desk import RunnerDesk
    from runner.service.jobs.records import RecordEvents

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "microvm_check"
# VM ready time is tens of milliseconds with a spare VM, seconds for a cold restore under TCG.
_READY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200)
_OVERHEAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_MAX_REASON = 64  # a blocked-egress reason comes from the service's own audit, but is stored next to guest data
# The name check's refusals by name (TLS SNI / HTTP Host), method and path prefix: names come from
# guest traffic, so the distinct series are capped for the process; later ones count as name "(other)".
NAMED_REASONS = ("name-refused", "unnamed", "block-listed", "request-refused")
MAX_NAMED_SERIES = 500
# API answers take milliseconds; a followed log stream lasts as long as its job.
_REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60, 600, 3600)
# The routes, as templates: a label never holds a job id or anything else a client chose.
API_ROUTES = ("/v1/health", "/v1/jobs", "/v1/status", "/v1/runner/job-started", "/v1/runner/job-completed",
              "/v1/jobs/{id}", "/v1/jobs/{id}/checkout", "/v1/jobs/{id}/logs", "/v1/jobs/{id}/artifacts",
              "/v1/jobs/{id}/attestation", "/v1/attestation-key", "/v1/jobs/{id}/cancel", "/metrics", "/ui",
              "/ui/jobs/{id}", "/ui/jobs/{id}/logs",
              "/ui/jobs/{id}/artifacts", "/ui/jobs/{id}/cancel", "/ui/jobs/{id}/log.txt", "/ui/insights", "/ui/static",
              "other")


def _version() -> str:
    try:
        return metadata.version("microvm-check")
    except metadata.PackageNotFoundError:
        return "unknown"


def route_of(path: str) -> str:
    """The API_ROUTES template a request path falls under ("other" for anything else)."""
    parts = path.split("/")
    if len(parts) >= 4 and parts[1] in ("v1", "ui") and parts[2] == "jobs" and parts[3]:
        template = "/".join(["", parts[1], "jobs", "{id}", *parts[4:]])
    elif path.startswith("/ui/static/"):
        template = "/ui/static"
    else:
        template = path.rstrip("/") or path
    return template if template in API_ROUTES else "other"


def result_of(state: str, exit_code: int | None) -> str:
    """A final job's result label: success and failure only for a command that ran to its end."""
    if state == JobState.FINISHED:
        return "success" if step_exit_code(state, exit_code) == 0 else "failure"
    return state


@dataclass(frozen=True)
class ServiceView:
    """What the scrape-time collector reads; each a callable so nothing is cached between scrapes."""

    active_jobs: Callable[[], list[JobRecord]]  # records in a non-final state
    queued: Callable[[], int]
    prewarmed: Callable[[], int]
    prewarm_max: int
    live_vms: Callable[[], int] | None = None  # None without an engine (tests above the VM layer); spares included
    spare_pool_size: int | None = None
    spare_vms: Callable[[], int] | None = None  # the engine's spare pool, all variants
    runners: Callable[[], list[FleetRunner]] | None = None  # the fleet's runners, when runners: is configured
    # the fleet's runners that ended before taking a job: (in all, in a row now; runner.fleet.starts)
    runner_failed_starts: Callable[[], tuple[int, int]] | None = None
    protocol_errors: Callable[[], dict[str, int]] | None = None  # Engine.protocol_errors, by kind
    webhook_deliveries: Callable[[], dict[tuple[str, str], int]] | None = None  # by (event, result)


class ServiceCollector(Collector):
    """Gauges read from the service at scrape time."""

    def __init__(self, view: ServiceView) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        view = self._view
        jobs = GaugeMetricFamily(f"{PREFIX}_jobs_active", "Jobs not yet final, by state", labels=["state"])
        counts = {state.value: 0 for state in ACTIVE_STATES}
        for record in view.active_jobs():
            counts[str(record.state)] = counts.get(str(record.state), 0) + 1
        for state, count in sorted(counts.items()):
            jobs.add_metric([state], count)
        yield jobs
        yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Jobs waiting for a worker", value=view.queued())
        yield GaugeMetricFamily(f"{PREFIX}_prewarmed_vms", "VMs restored for an announced job", value=view.prewarmed())
        yield GaugeMetricFamily(f"{PREFIX}_prewarmed_vms_max", "prewarm.max_vms", value=view.prewarm_max)
        if view.live_vms is not None:
            yield GaugeMetricFamily(f"{PREFIX}_vms_running",
                                    "VMs alive on the engine (jobs, spares, pre-warmed, VMMs spawned ahead)",
                                    value=view.live_vms())
        if view.spare_vms is not None:
            yield GaugeMetricFamily(f"{PREFIX}_spare_vms", "Spare VMs restored and waiting for a job (part of "
                                    "vms_running)", value=view.spare_vms())
        if view.spare_pool_size is not None:
            yield GaugeMetricFamily(f"{PREFIX}_spare_pool_size", "Spare VMs kept ready per snapshot",
                                    value=view.spare_pool_size)
        if view.runners is not None:
            runners = GaugeMetricFamily(f"{PREFIX}_runners", "The fleet's runners, by state", labels=["state"])
            by_state: dict[str, int] = {}
            for runner in view.runners():
                state = str(getattr(runner.state, "value", runner.state))
                by_state[state] = by_state.get(state, 0) + 1
            for state, count in sorted(by_state.items()):
                runners.add_metric([state], count)
            yield runners
        if view.runner_failed_starts is not None:
            yield from _failed_starts(*view.runner_failed_starts())
        if view.protocol_errors is not None:
            errors = CounterMetricFamily(f"{PREFIX}_guest_protocol_errors",
                                         "VMs destroyed because their guest broke the agent protocol, by kind",
                                         labels=["kind"])
            for kind, count in sorted(view.protocol_errors().items()):
                errors.add_metric([kind], count)
            yield errors
        if view.webhook_deliveries is not None:
            deliveries = CounterMetricFamily(f"{PREFIX}_webhook_deliveries", "Webhook requests answered, by result",
                                             labels=["event", "result"])
            for (event, result), count in sorted(view.webhook_deliveries().items()):
                deliveries.add_metric([event, result], count)
            yield deliveries


def _failed_starts(total: int, in_a_row: int) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Runners that ended before taking a job, and whether the fleet reports a crash loop (so many in a row)."""
    from runner.fleet.starts import CRASH_LOOP_TRIES

    yield CounterMetricFamily(f"{PREFIX}_runner_failed_starts", "Fleet runners that ended on their own before "
                              "taking a job (each is retried after a back-off)", value=total)
    yield GaugeMetricFamily(f"{PREFIX}_runner_crash_loop", f"1 while the fleet reports a crash loop: "
                            f"{CRASH_LOOP_TRIES} or more runners in a row ended before taking a job (`status` says why)",
                            value=int(in_a_row >= CRASH_LOOP_TRIES))


class JobMetrics:
    """A service instance's registry: the per-job counters and histograms, and the scrape-time gauges."""

    def __init__(self) -> None:
        # `_created` series: the library exports them as extra gauges per counter and histogram, which
        # dashboards mistake for data; process-wide in prometheus_client, and the service's registries are
        # the only ones in its process.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        build_info = Gauge(f"{PREFIX}_build_info", "The running build (always 1)", ["version", "python"], registry=r)
        build_info.labels(_version(), platform.python_version()).set(1)
        self.requests = Histogram(f"{PREFIX}_api_request_duration_seconds",
                                  "Job API and page requests answered, by listener, route, method and status; "
                                  "a log stream lasts until its job ends", ["listener", "route", "method", "status"],
                                  buckets=_REQUEST_BUCKETS, registry=r)
        self.jobs = Counter(f"{PREFIX}_jobs", "Jobs ended, by final state and result", ["state", "result"], registry=r)
        self.vm_ready = Histogram(f"{PREFIX}_vm_ready_seconds", "From a job's start to its VM answering",
                                  ["warm"], buckets=_READY_BUCKETS, registry=r)
        self.duration = Histogram(f"{PREFIX}_job_duration_seconds", "The job's command, from start to end, by "
                                  "result", ["result"], buckets=_DURATION_BUCKETS, registry=r)
        self.overhead = Histogram(f"{PREFIX}_job_overhead_seconds",
                                  "From a job's checkout queued to its command started (VM, network, checkout)",
                                  buckets=_OVERHEAD_BUCKETS, registry=r)
        self.runners_started = Counter(f"{PREFIX}_runners_started", "Fleet runners registered and started",
                                       registry=r)
        self.runners_ended = Counter(f"{PREFIX}_runners_ended", "Fleet runners ended, by whether a job was "
                                     "reported by them (churn: many ending without one)", ["had_job"], registry=r)
        self.blocked = Counter(f"{PREFIX}_blocked_egress_attempts", "Egress attempts refused, by reason",
                               ["reason"], registry=r)
        self.blocked_named = Counter(f"{PREFIX}_blocked_egress_named_attempts",
                                     "Connections the name check refused, by reason, the name claimed (TLS SNI / "
                                     "HTTP Host; \"\" for none), method and path prefix; at most "
                                     f"{MAX_NAMED_SERIES} names, then \"(other)\"",
                                     ["reason", "name", "method", "path"], registry=r)
        self._named: set[tuple[str, str, str, str]] = set()

    def runner_started(self) -> None:
        self.runners_started.inc()

    def runner_ended(self, had_job: bool) -> None:
        self.runners_ended.labels(str(had_job).lower()).inc()

    def watch(self, view: ServiceView) -> None:
        self.registry.register(ServiceCollector(view))

    def saw(self, record: JobRecord) -> None:
        """A job record was saved: count it if it just became final."""
        if not record.final:  # a record turns final once (JobState allows no move out of a final state)
            return
        state = str(record.state)
        self.jobs.labels(state, result_of(state, record.exit_code)).inc()
        t = record.timings
        if t.vm_ready_ms is not None:
            self.vm_ready.labels(str(bool(record.warm)).lower()).observe(t.vm_ready_ms / 1000)
        if t.started_at is not None and t.finished_at is not None:
            self.duration.labels(result_of(state, record.exit_code)).observe(max(0.0, t.finished_at - t.started_at))
        if t.queued_at is not None and t.started_at is not None:
            self.overhead.observe(max(0.0, t.started_at - t.queued_at))
        for entry in record.blocked_egress:
            self.blocked.labels(entry.reason[:_MAX_REASON]).inc(entry.count)
        self._count_named(record.blocked_egress)

    def _count_named(self, entries: Iterable[AuditRecord]) -> None:
        """The name check's refusals by what they claimed, read as the summary reads them (only a name the
        policy loader accepts gets through: `policy.suggest.admitted`)."""
        from policy.suggest import admitted

        for entry in entries:
            found = admitted(entry)
            if found is None or found.reason not in NAMED_REASONS:
                continue
            labels = (found.reason, found.name or "", found.method or "", found.path or "")
            if labels not in self._named and len(self._named) >= MAX_NAMED_SERIES:
                labels = (found.reason, "(other)", "", "")
            self._named.add(labels)
            self.blocked_named.labels(*labels).inc(found.count)

    def request(self, listener: str, route: str, method: str, status: int, seconds: float) -> None:
        """One answered API request; `route` is one of API_ROUTES (the caller maps the path)."""
        method = method if method in ("GET", "HEAD", "POST", "PUT") else "other"
        self.requests.labels(listener, route, method, str(status)).observe(max(0.0, seconds))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EventsTee:
    """The record store's event sink, followed by the metrics: both see every saved record."""

    def __init__(self, first: RecordEvents, metrics: JobMetrics) -> None:
        self._first, self._metrics = first, metrics

    def saw(self, record: JobRecord) -> None:
        self._first.saw(record)
        self._metrics.saw(record)


class CountedRunners:
    """The job service as the runner fleet sees it (runner.fleet.fleet.FleetService), with each runner's start and
    end counted: the fleet calls `add_runner` once per runner it starts and `remove_runner` once as it ends."""

    def __init__(self, desk: RunnerDesk, metrics: JobMetrics) -> None:
        self._service, self._metrics = desk, metrics

    def add_runner(self, name: str, token: str) -> None:
        self._service.add_runner(name, token)
        self._metrics.runner_started()

    def remove_runner(self, name: str) -> None:
        had_job = self._service.runner_job(name) is not None
        self._service.remove_runner(name)
        self._metrics.runner_ended(had_job)

    def runner_job(self, name: str) -> JobStarted | None:
        return self._service.runner_job(name)

    def runner_died(self, runner_name: str, reason: str) -> list[str]:
        return list(self._service.runner_died(runner_name, reason))
