"""The service config's `webhook:` section, handed to `runner.github.webhooks` with the service as its hooks.

The endpoint is off unless `listen` is set. The secret is read from a file, never written in the
service config, so the config can be world-readable. The section is checked when the config loads
(`runner.service.config.settings.WebhookSettings`); here only what needs the file system or GitHub is done.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_network
from typing import TYPE_CHECKING, Protocol

from runner.service.config.reading import ConfigError, webhook_from_mapping
from runner.service.config.settings import WebhookSettings

if TYPE_CHECKING:  # for annotations only: the endpoint's modules load when it is configured
    from runner.github.deliveries import RedeliverySweep
    from runner.github.jobs import CompletedJob, InProgressJob, JobHooks, Push, QueuedJob
    from runner.github.webhooks import WebhookServer


@dataclass
class Webhook:
    """The running endpoint and, when configured, its redelivery sweep: closed together."""

    server: WebhookServer
    sweep_stop: threading.Event | None = None
    sweep: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server.port

    def close(self) -> None:
        if self.sweep_stop is not None and self.sweep is not None:
            self.sweep_stop.set()
            self.sweep.join()
        self.server.close()


def _sweep(settings: WebhookSettings, where: str) -> RedeliverySweep | None:
    """GitHub drops webhooks under load: a sweep that asks it to redeliver failed ones, or None when not
    configured. Only built here (the App settings are read now); its thread starts with the endpoint."""
    if settings.redeliver_every is None:
        return None
    from runner.github.config import load_settings
    from runner.github.deliveries import RedeliverySweep
    from runner.github.errors import GitHubError

    try:
        github = load_settings(settings.github_config)
        return RedeliverySweep(github.app().as_app)
    except GitHubError as exc:
        raise ConfigError(f"{where}.redeliver_every: needs the GitHub App settings: {exc}") from exc


def _start_sweep(sweep: RedeliverySweep, interval: float) -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=sweep.run, args=(stop, interval), name="redelivery-sweep", daemon=True)
    thread.start()
    return stop, thread


def _secret(settings: WebhookSettings, where: str) -> bytes:
    path = settings.secret_path
    if path is None:  # the loader already refuses listen without secret_path; this keeps the type honest
        raise ConfigError(f"{where}.secret_path: required when listen is set (a file holding the webhook secret)")
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{where}.secret_path: cannot read {path}: {exc.strerror}") from exc
    if not secret:
        raise ConfigError(f"{where}.secret_path: {path} is empty")
    return secret


def _networks(cidrs: tuple[str, ...], where: str) -> tuple[IPv4Network | IPv6Network, ...]:
    try:
        return tuple(ip_network(cidr.strip(), strict=False) for cidr in cidrs)
    except ValueError as exc:
        raise ConfigError(f"{where}.allow_sources: {exc}; give networks like 192.30.252.0/22") from None


class JobListener(Protocol):
    """What every listener hears; `job_in_progress` and `default_branch_pushed` are optional (see
    `JobHookListeners`)."""

    def prewarm(self, job: QueuedJob) -> None: ...

    def job_completed(self, job: CompletedJob) -> None: ...


@dataclass(frozen=True)
class JobHookListeners:
    """Several `JobHooks` hearing the same deliveries (the job service, which pre-warms VMs, and the
    runner fleet, which starts runners), called in order; the first failure fails the delivery, so
    GitHub's redelivery brings it to every listener again (each takes a repeat as a no-op)."""

    listeners: tuple[JobListener, ...]

    def prewarm(self, job: QueuedJob) -> None:
        for listener in self.listeners:
            listener.prewarm(job)

    def job_in_progress(self, job: InProgressJob) -> None:
        """Only the job service binds registered runners; the fleet's runners are bound by their own hooks."""
        for listener in self.listeners:
            if hasattr(listener, "job_in_progress"):
                listener.job_in_progress(job)

    def job_completed(self, job: CompletedJob) -> None:
        for listener in self.listeners:
            listener.job_completed(job)

    def default_branch_pushed(self, push: Push) -> None:
        """Only the job service keeps warm bases; a listener without bases (the fleet) has nothing to do."""
        for listener in self.listeners:
            if hasattr(listener, "default_branch_pushed"):
                listener.default_branch_pushed(push)


def start_webhook(settings: WebhookSettings | Mapping[str, object], hooks: JobHooks, where: str = "webhook") -> Webhook | None:
    """Start the GitHub webhook endpoint described by `settings` (a loaded section, or a mapping that is
    checked like one); None when it is not configured."""
    if not isinstance(settings, WebhookSettings):
        settings = webhook_from_mapping(dict(settings))
    if settings.listen is None:
        return None
    from runner.github.webhooks import WebhookConfig, WebhookReceiver, WebhookServer  # only when used

    config = WebhookConfig(secret=_secret(settings, where), labels=settings.labels, max_body=settings.max_body,
                           allow_sources=_networks(settings.allow_sources or (), where))
    sweep = _sweep(settings, where)
    server = WebhookServer(WebhookReceiver(config, hooks), *settings.listen)  # binds: may fail, nothing runs yet
    server.start()
    if sweep is None or settings.redeliver_every is None:
        return Webhook(server)
    return Webhook(server, *_start_sweep(sweep, settings.redeliver_every))
