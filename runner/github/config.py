"""Where the GitHub integration's settings come from: one YAML file, overridable by environment.

Secrets are never in the file itself, only the path to the App's private key, so the file can be
world-readable and kept in configuration management. It is read like the service config and the
policies (`policy.yamldoc`): no aliases, bounded size, unknown keys refused (a typo must not silently
drop a setting), and every problem reported at once with its line. The webhook endpoint is configured in the
service's own config (`runner.service.github.webhook`), which hands it to `runner.github.webhooks`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from policy.yamldoc import (
    DocumentLimits,
    Problems,
    compose,
    decimal_int,
    is_null,
    kind,
    mapping,
    quote,
    read_text,
    sort_problems,
    string,
)
from runner.github.client import DEFAULT_API_URL
from runner.github.errors import GitHubError

if TYPE_CHECKING:
    from runner.github.app import AppCredentials, GitHubApp

DEFAULT_CONFIG_PATH = Path("/etc/microvm-check/github.yml")
CONFIG_ENV = "MICROVM_CHECK_GITHUB_CONFIG"
ENV_PREFIX = "MICROVM_CHECK_GITHUB_"
DEFAULT_LABELS = ("microvm",)
ENV_FIELDS = ("app_id", "client_id", "private_key_path", "installation_id", "org", "app_slug", "api_url")
KEYS = (*ENV_FIELDS, "labels")
LIMITS = DocumentLimits("GitHub config", 64 * 1024, 4, "a GitHub config is a flat mapping of settings with a labels list")
MAX_STRING = 4096
MAX_LABELS = 64


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
        from runner.github.app import AppCredentials  # jwt and cryptography only when the App is used

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
        from runner.github.app import GitHubApp

        return GitHubApp(self.credentials(), api_url=self.api_url)


def load_settings(path: Path | None = None, env: Mapping[str, str] = os.environ) -> GitHubSettings:
    """Read the config file (when present) and apply `MICROVM_CHECK_GITHUB_*` variables over it.
    Raises `GitHubError` listing every problem, each with its file:line:col or variable name; the
    messages name only the file and the variables this call actually read."""
    named_by_env = path is None and bool(env.get(CONFIG_ENV))
    explicit = path or (Path(env[CONFIG_ENV]) if named_by_env else None)
    source = explicit or DEFAULT_CONFIG_PATH
    variables = [ENV_PREFIX + name.upper() for name in ENV_FIELDS if env.get(ENV_PREFIX + name.upper())]
    _require_some(source, explicit is not None, named_by_env, variables)
    read = source.exists()
    problems = Problems(str(source) if read else "environment")
    entries = _read_yaml(source, problems) if read else {}
    for name in variables:
        entries[name.removeprefix(ENV_PREFIX).lower()] = _Entry(env[name], None, name)
    settings = _settings(entries, problems, _where(source, read, variables)) if not problems.items else None
    if problems.items or settings is None:
        raise GitHubError("\n".join(str(p) for p in sort_problems(problems.final())))
    return settings


def _require_some(source: Path, explicit: bool, named_by_env: bool, variables: list[str]) -> None:
    """A file that was asked for must exist; without one, some variable must say something."""
    if explicit and not source.exists():
        if named_by_env:
            raise GitHubError(f"GitHub config {source} (named by {CONFIG_ENV}) does not exist: create it or fix "
                              f"{CONFIG_ENV}")
        raise GitHubError(f"GitHub config {source} does not exist: create it, or name the file that holds the "
                          f"GitHub App's settings")
    if not source.exists() and not variables:
        raise GitHubError(f"no GitHub App settings: {source} does not exist; create it with the App's client_id "
                          f"(or app_id) and private_key_path (see the README, 'Register with an organisation')")


def _where(source: Path, read: bool, variables: list[str]) -> str:
    """Where a missing setting was looked for, in the words of what the user set."""
    if not read:
        return f"in the environment (it sets {', '.join(variables)}; {source} does not exist)"
    if variables:
        return f"in {source} (nor in the environment, which sets {', '.join(variables)})"
    return f"in {source}"


@dataclass(frozen=True)
class _Entry:
    """One setting: its value (a node from the file, or text from the environment), and where it came from."""

    text: str | None
    node: yaml.Node | None
    name: str

    def problem(self, problems: Problems, message: str) -> None:
        if self.node is not None:
            problems.at(self.node, f"{self.name}: {message}")
        else:
            problems.add(None, f"{self.name}: {message}")


def _read_yaml(path: Path, problems: Problems) -> dict[str, _Entry]:
    text = read_text(path, LIMITS, problems)
    node = compose(text, LIMITS, problems) if text is not None else None
    if node is None or is_null(node):
        return {}
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"a GitHub config must be a mapping of settings ({', '.join(KEYS)}), not {kind(node)}")
        return {}
    values, _ = mapping(node, KEYS, "the GitHub config", problems)
    return {key: _Entry(string(value), value, key) for key, value in values.items()}


def _settings(entries: dict[str, _Entry], problems: Problems, where: str) -> GitHubSettings | None:
    if "private_key_path" not in entries:
        problems.add(None, f"private_key_path is not set {where}: point it at the App's private key (.pem)")
    if "app_id" not in entries and "client_id" not in entries:
        problems.add(None, f"neither client_id nor app_id is set {where}: copy one from the App's settings")
    strings = {name: _text(entries.get(name), problems)
               for name in ("private_key_path", "client_id", "org", "app_slug", "api_url")}
    numbers = {name: _int(entries.get(name), problems) for name in ("app_id", "installation_id")}
    labels = _labels(entries.get("labels"), problems)
    if problems.items:
        return None
    key_path = strings["private_key_path"]
    assert key_path is not None, "a missing or unreadable private_key_path is a problem above"
    return GitHubSettings(
        private_key_path=Path(key_path),
        app_id=numbers["app_id"],
        client_id=strings["client_id"],
        installation_id=numbers["installation_id"],
        org=strings["org"],
        app_slug=strings["app_slug"],
        api_url=strings["api_url"] or DEFAULT_API_URL,
        labels=labels,
    )


def _text(entry: _Entry | None, problems: Problems) -> str | None:
    if entry is None:
        return None
    value = entry.text
    if value is None:
        assert entry.node is not None, "only an entry from the file can lack text; the environment's are text"
        entry.problem(problems, f"expected a string (in quotes if it looks like a number), not {kind(entry.node)}")
    elif not value or len(value) > MAX_STRING or "\0" in value:
        entry.problem(problems, f"expected a non-empty string of at most {MAX_STRING} characters without NUL, "
                                f"not {quote(value)}")
        return None
    return value


def _int(entry: _Entry | None, problems: Problems) -> int | None:
    if entry is None:
        return None
    value = decimal_int(entry.node) if entry.node is not None else None
    if entry.node is None and entry.text is not None and entry.text.isascii() and entry.text.isdigit() \
            and len(entry.text) <= 10:
        value = int(entry.text)
    if value is None or not 0 < value < 2**63:
        shown = kind(entry.node) if entry.node is not None else quote(entry.text or "")
        entry.problem(problems, f"must be a positive whole number, not {shown}")
        return None
    return value


def _labels(entry: _Entry | None, problems: Problems) -> tuple[str, ...]:
    if entry is None:
        return DEFAULT_LABELS
    node = entry.node
    items = [string(item) for item in node.value] if isinstance(node, yaml.SequenceNode) else []
    labels = tuple(item for item in items if item and len(item) <= 100)
    if not items or len(items) > MAX_LABELS or len(labels) != len(items):
        entry.problem(problems, f"expected a non-empty list of at most {MAX_LABELS} label names, "
                                f"not {kind(node) if node is not None else 'nothing'}")
        return DEFAULT_LABELS
    return labels
