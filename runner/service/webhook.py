"""The service config's `webhook:` section, handed to `runner.github.webhooks` with the service as its hooks.

The endpoint is off unless `listen` is set. The secret is read from a file, never written in the
service config, so the config can be world-readable.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.service.config import ConfigError, parse_listen, parse_size, webhook_settings


@dataclass
class Webhook:
    """The running endpoint and, when configured, its redelivery sweep: stopped together."""

    server: Any
    sweep_stop: threading.Event | None = None
    sweep: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        if self.sweep_stop is not None:
            self.sweep_stop.set()
            self.sweep.join()
        self.server.stop()


def _start_sweep(settings: dict[str, Any], where: str) -> tuple[threading.Event, threading.Thread] | None:
    """GitHub drops webhooks under load: ask it every `redeliver_every` seconds to redeliver failed ones."""
    every = settings.get("redeliver_every")
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, (int, float)) or every < 30:
        raise ConfigError(f"{where}.redeliver_every: seconds between sweeps, at least 30 (got {every!r})")
    from runner.github.config import load_settings
    from runner.github.deliveries import RedeliverySweep
    from runner.github.errors import GitHubError

    try:
        github = load_settings(Path(settings["github_config"]) if settings.get("github_config") else None)
        sweep = RedeliverySweep(github.app().as_app)
    except GitHubError as exc:
        raise ConfigError(f"{where}.redeliver_every: needs the GitHub App settings: {exc}") from exc
    stop = threading.Event()
    thread = threading.Thread(target=sweep.run, args=(stop, float(every)), name="redelivery-sweep", daemon=True)
    thread.start()
    return stop, thread


def start_webhook(settings: dict[str, Any], hooks: Any, where: str = "webhook") -> Webhook | None:
    """Start the GitHub webhook endpoint described by `settings`; None when it is not configured."""
    settings = webhook_settings(settings, where)
    if not settings.get("listen"):
        return None
    from runner.github.webhooks import WebhookConfig, WebhookReceiver, WebhookServer  # only when used

    host, port = parse_listen(str(settings["listen"]), f"{where}.listen")
    secret_path = settings.get("secret_path")
    if not secret_path:
        raise ConfigError(f"{where}.secret_path: required when listen is set (a file holding the webhook secret)")
    try:
        secret = Path(secret_path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{where}.secret_path: cannot read {secret_path}: {exc.strerror}") from exc
    if not secret:
        raise ConfigError(f"{where}.secret_path: {secret_path} is empty")
    labels = settings.get("labels") or ["microvm"]
    if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
        raise ConfigError(f"{where}.labels: expected a list of runner labels")
    config = WebhookConfig(secret=secret, labels=tuple(labels),
                           max_body=parse_size(settings.get("max_body", 1024 * 1024), f"{where}.max_body"))
    sweep = _start_sweep(settings, where)
    server = WebhookServer(WebhookReceiver(config, hooks), host, port)
    server.start()
    return Webhook(server, *(sweep or (None, None)))
