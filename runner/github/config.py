"""Where the GitHub integration's settings come from: one YAML file, overridable by environment.

Secrets are never in the file itself, only the path to the App's private key, so the file can be
world-readable and kept in configuration management. The webhook endpoint is configured in the
service's own config (`runner.service.webhook`), which hands it to `runner.github.webhooks`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runner.github.app import AppCredentials, GitHubApp
from runner.github.client import DEFAULT_API_URL
from runner.github.errors import GitHubError

DEFAULT_CONFIG_PATH = Path("/etc/microvm-check/github.yml")
CONFIG_ENV = "MICROVM_CHECK_GITHUB_CONFIG"
ENV_PREFIX = "MICROVM_CHECK_GITHUB_"
DEFAULT_LABELS = ("microvm",)
ENV_FIELDS = ("app_id", "client_id", "private_key_path", "installation_id", "org", "app_slug", "api_url")


@dataclass(frozen=True)
class GitHubSettings:
    private_key_path: Path
    app_id: int | None = None
    client_id: str | None = None
    installation_id: int | None = None
    org: str | None = None
    app_slug: str | None = None
    api_url: str = DEFAULT_API_URL
    labels: tuple[str, ...] = DEFAULT_LABELS

    def credentials(self) -> AppCredentials:
        return AppCredentials.from_key_file(
            self.private_key_path,
            app_id=self.app_id,
            client_id=self.client_id,
            installation_id=self.installation_id,
            org=self.org,
            app_slug=self.app_slug,
        )

    def app(self) -> GitHubApp:
        """The App these settings describe; it reads the private key now."""
        return GitHubApp(self.credentials(), api_url=self.api_url)


def load_settings(path: Path | None = None, env: Mapping[str, str] = os.environ) -> GitHubSettings:
    """Read the config file (when present) and apply `MICROVM_CHECK_GITHUB_*` variables over it."""
    explicit = path or (Path(env[CONFIG_ENV]) if env.get(CONFIG_ENV) else None)
    raw = _read_yaml(explicit or DEFAULT_CONFIG_PATH, required=explicit is not None)
    for name in ENV_FIELDS:
        if env.get(ENV_PREFIX + name.upper()):
            raw[name] = env[ENV_PREFIX + name.upper()]
    return _settings(raw, explicit or DEFAULT_CONFIG_PATH)


def _read_yaml(path: Path, *, required: bool) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        if required:
            raise GitHubError(f"GitHub config {path} does not exist: create it or fix {CONFIG_ENV}") from None
        return {}
    except OSError as exc:
        raise GitHubError(f"cannot read GitHub config {path}: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise GitHubError(f"GitHub config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise GitHubError(f"GitHub config {path} must be a mapping of settings")
    return data


def _settings(raw: dict[str, Any], source: Path) -> GitHubSettings:
    where = f"in {source} (or {ENV_PREFIX}*)"
    if not raw.get("private_key_path"):
        raise GitHubError(f"private_key_path is not set {where}: point it at the App's private key (.pem)")
    if not (raw.get("app_id") or raw.get("client_id")):
        raise GitHubError(f"neither client_id nor app_id is set {where}: copy one from the App's settings")
    labels = raw.get("labels", list(DEFAULT_LABELS))
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) and x for x in labels):
        raise GitHubError(f"labels {where} must be a non-empty list of label names")
    return GitHubSettings(
        private_key_path=Path(str(raw["private_key_path"])),
        app_id=_int(raw.get("app_id"), "app_id", where),
        client_id=str(raw["client_id"]) if raw.get("client_id") else None,
        installation_id=_int(raw.get("installation_id"), "installation_id", where),
        org=str(raw["org"]) if raw.get("org") else None,
        app_slug=str(raw["app_slug"]) if raw.get("app_slug") else None,
        api_url=str(raw.get("api_url") or DEFAULT_API_URL),
        labels=tuple(labels),
    )


def _int(value: Any, name: str, where: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise GitHubError(f"{name} {where} must be a number, not {value!r}") from None
