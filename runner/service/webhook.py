"""The service config's `webhook:` section, handed to `runner.github.webhooks` with the service as its hooks.

The endpoint is off unless `listen` is set. The secret is read from a file, never written in the
service config, so the config can be world-readable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.service.config import ConfigError, parse_size

_KEYS = ("listen", "secret_path", "labels", "max_body")


def start_webhook(settings: dict[str, Any], hooks: Any, where: str = "webhook") -> Any:
    """Start the GitHub webhook endpoint described by `settings`; None when it is not configured."""
    if not settings.get("listen"):
        return None
    from runner.github.webhooks import WebhookConfig, WebhookReceiver, WebhookServer  # only when used

    unknown = sorted(set(settings) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown setting (expected {', '.join(_KEYS)})")
    host, _, port = str(settings["listen"]).rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{where}.listen: expected HOST:PORT, got {settings['listen']!r}")
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
    server = WebhookServer(WebhookReceiver(config, hooks), host.strip("[]"), int(port))
    server.start()
    return server
