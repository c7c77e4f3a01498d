"""The service's YAML configuration.

Every limit the service enforces against hostile guests and clients lives here, so an operator can
read in one file what a job may cost the host. Errors name the file and the key, because a service
that refuses to start must say exactly what to fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import yaml

from policy.model import Rule
from policy.render import OperatorAllowances

DEFAULT_SOCKET = "/run/microvm-check/api.sock"
DEFAULT_STATE_DIR = "/var/lib/microvm-check"

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


class ConfigError(ValueError):
    """A configuration the service refuses to start with; the message names the file and key."""


@dataclass(frozen=True)
class Resources:
    vcpus: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class ArtifactLimits:
    max_count: int = 1000
    max_total_bytes: int = 512 * 1024**2


@dataclass(frozen=True)
class LogLimits:
    max_bytes: int = 16 * 1024**2  # per job; beyond it output is dropped with a system note
    max_entry_bytes: int = 64 * 1024  # larger chunks are split so no single entry is huge


@dataclass(frozen=True)
class Retention:
    days: float = 14.0
    max_records: int = 10000


@dataclass(frozen=True)
class Prewarm:
    max_vms: int = 2
    expire_seconds: float = 300.0


@dataclass(frozen=True)
class Network:
    """Per-VM networking (runner.net). Off by default: then no job VM gets a network card, and a job
    whose effective policy allows any egress is refused at submit."""

    enabled: bool = False
    uplink_interface: str | None = None  # None: the interface of the default route
    slot_prefix: str = "mvc"
    slots: int = 0  # network slots made ahead of time
    allow: OperatorAllowances = field(default_factory=OperatorAllowances)  # opens always-denied destinations


@dataclass(frozen=True)
class ServiceConfig:
    socket: str = DEFAULT_SOCKET
    socket_group: str | None = None
    listen: tuple[str, int] | None = None
    token: str | None = None
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    templates: tuple[str, ...] = ("base",)
    resources: Resources = field(default_factory=Resources)
    max_concurrent_jobs: int = 2
    max_queued_jobs: int = 32
    checkout_max_bytes: int = 1024**3
    checkout_wait_seconds: float = 600.0  # a submitted job whose checkout never comes is dropped
    default_timeout_seconds: int = 3600
    max_timeout_seconds: int = 6 * 3600
    artifacts: ArtifactLimits = field(default_factory=ArtifactLimits)
    logs: LogLimits = field(default_factory=LogLimits)
    policy_dir: Path | None = None
    github_config: Path | None = None  # App settings: policies from the repositories' default branches
    retention: Retention = field(default_factory=Retention)
    prewarm: Prewarm = field(default_factory=Prewarm)
    network: Network = field(default_factory=Network)
    shutdown_grace_seconds: float = 30.0
    env_allowlist: tuple[str, ...] = ("CI", "GITHUB_*", "RUNNER_*")
    webhook: dict[str, Any] = field(default_factory=dict)

    @property
    def default_template(self) -> str:
        return self.templates[0]

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    @property
    def records_path(self) -> Path:
        return self.state_dir / "jobs.sqlite"


def parse_size(value: Any, where: str) -> int:
    """Accept `1048576`, `"512MiB"`, `"1G"`: operators write sizes by hand."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a size like 512MiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: must not be negative")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f"{where}: expected a size like 512MiB or 1G, got {value!r}")
    unit = (match.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(match.group(1)) * _UNITS[unit]


class _Reader:
    """Pulls typed values out of one mapping and remembers which keys it consumed."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where
        self.seen: set[str] = set()

    def _get(self, key: str) -> Any:
        self.seen.add(key)
        return self.data.get(key)

    def at(self, key: str) -> str:
        return f"{self.where}{key}"

    def string(self, key: str, default: str | None) -> str | None:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.at(key)}: expected a non-empty string, got {value!r}")
        return value

    def number(self, key: str, default: float, minimum: float, kind: type = int) -> Any:
        value = self._get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise ConfigError(f"{self.at(key)}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{self.at(key)}: must be at least {minimum}, got {value}")
        return kind(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ConfigError(f"{self.at(key)}: expected true or false, got {value!r}")
        return value

    def size(self, key: str, default: int) -> int:
        value = self._get(key)
        return default if value is None else parse_size(value, self.at(key))

    def section(self, key: str) -> _Reader:
        value = self._get(key)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{self.at(key)}: expected a mapping, got {type(value).__name__}")
        return _Reader(value, f"{self.at(key)}.")

    def string_list(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{self.at(key)}: expected a non-empty list of strings, got {value!r}")
        return tuple(value)

    def check_unknown(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise ConfigError(f"{self.where}{unknown[0]}: unknown setting (a typo?)")


def parse_listen(value: str, where: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise ConfigError(f"{where}: expected HOST:PORT like 127.0.0.1:8470, got {value!r}")
    return host.strip("[]"), int(port)


def _allowances(value: Any, where: str) -> OperatorAllowances:
    """`network.allow`: the operator's network rules, applied to every networked VM before the
    always-denied destinations, so they alone can open e.g. a proxy on the host or the metadata service."""
    if value is None:
        return OperatorAllowances()
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of rules like {{cidr: 10.0.0.5/32, ports: [3128]}}, "
                          f"got {type(value).__name__}")
    return OperatorAllowances(tuple(_allowance(item, f"{where}[{index}]") for index, item in enumerate(value)))


def _allowance(item: Any, where: str) -> Rule:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a mapping with cidr, ports and protocol, got {type(item).__name__}")
    unknown = sorted(set(item) - {"cidr", "ports", "protocol"}, key=str)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; a rule has cidr, ports and protocol "
                          "(no host names here)")
    try:
        network = ip_network(str(item["cidr"]), strict=True)
    except KeyError:
        raise ConfigError(f"{where}.cidr: missing; give a network like 169.254.169.254/32") from None
    except ValueError as exc:
        raise ConfigError(f"{where}.cidr: {exc}; give a network like 169.254.169.254/32") from None
    ports = item.get("ports")
    if not isinstance(ports, list):
        raise ConfigError(f"{where}.ports: expected a list of port numbers like [80, 443], got {ports!r}")
    try:
        return Rule(frozenset(ports), item.get("protocol", "tcp"), network=network)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


WEBHOOK_KEYS = ("listen", "secret_path", "labels", "max_body", "redeliver_every", "github_config")


def webhook_settings(value: Any, where: str, base: Path = Path(".")) -> dict[str, Any]:
    """The `webhook:` section checked like the rest of the config, when it is loaded: unknown keys,
    `listen`, and file paths relative to the config file. `runner.service.webhook` starts the endpoint."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - set(WEBHOOK_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown setting (expected {', '.join(WEBHOOK_KEYS)})")
    settings = dict(value)
    if settings.get("listen"):
        parse_listen(str(settings["listen"]), f"{where}.listen")
    for key in ("secret_path", "github_config"):
        if settings.get(key):
            settings[key] = str(base / str(settings[key]))
    return settings


def _token(top: _Reader, listen: tuple[str, int] | None, base: Path) -> str | None:
    token = top.string("token", None)
    token_file = top.string("token_file", None)
    if token and token_file:
        raise ConfigError(f"{top.at('token')}: set either token or token_file, not both")
    if token_file:
        path = (base / token_file).resolve()
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{top.at('token_file')}: cannot read {path}: {exc.strerror}") from exc
    if listen and (not token or len(token) < 16):
        raise ConfigError(f"{top.at('listen')}: TCP needs a bearer token of at least 16 characters (token or token_file)")
    return token


def config_from_mapping(data: dict[str, Any], where: str = "", base: Path = Path(".")) -> ServiceConfig:
    """Build a validated config; `where` prefixes error messages (the file name), `base` resolves relative paths."""
    top = _Reader(data, where)
    listen_at = top.string("listen", None)
    listen = parse_listen(listen_at, top.at("listen")) if listen_at is not None else None
    resources = top.section("resources")
    artifacts = top.section("artifacts")
    logs = top.section("logs")
    retention = top.section("retention")
    prewarm = top.section("prewarm")
    network = top.section("network")
    policy_dir = top.string("policy_dir", None)
    github_config = top.string("github_config", None)
    config = ServiceConfig(
        socket=top.string("socket", DEFAULT_SOCKET),
        socket_group=top.string("socket_group", None),
        listen=listen,
        token=_token(top, listen, base),
        state_dir=(base / top.string("state_dir", DEFAULT_STATE_DIR)).resolve(),
        templates=top.string_list("templates", ("base",)),
        resources=Resources(
            vcpus=resources.number("vcpus", None, 1),
            memory_mib=resources.number("memory_mib", None, 64),
        ),
        max_concurrent_jobs=top.number("max_concurrent_jobs", 2, 1),
        max_queued_jobs=top.number("max_queued_jobs", 32, 1),
        checkout_max_bytes=top.size("checkout_max_bytes", 1024**3),
        checkout_wait_seconds=top.number("checkout_wait_seconds", 600.0, 1, float),
        default_timeout_seconds=top.number("default_timeout_seconds", 3600, 1),
        max_timeout_seconds=top.number("max_timeout_seconds", 6 * 3600, 1),
        artifacts=ArtifactLimits(
            max_count=artifacts.number("max_count", 1000, 0),
            max_total_bytes=artifacts.size("max_total_bytes", 512 * 1024**2),
        ),
        logs=LogLimits(
            max_bytes=logs.size("max_bytes", 16 * 1024**2),
            max_entry_bytes=logs.size("max_entry_bytes", 64 * 1024),
        ),
        policy_dir=(base / policy_dir).resolve() if policy_dir else None,
        github_config=(base / github_config).resolve() if github_config else None,
        retention=Retention(
            days=retention.number("days", 14.0, 0, float),
            max_records=retention.number("max_records", 10000, 1),
        ),
        prewarm=Prewarm(
            max_vms=prewarm.number("max_vms", 2, 0),
            expire_seconds=prewarm.number("expire_seconds", 300.0, 1, float),
        ),
        network=Network(
            enabled=network.boolean("enabled", False),
            uplink_interface=network.string("uplink_interface", None),
            slot_prefix=network.string("slot_prefix", "mvc"),
            slots=network.number("slots", 0, 0),
            allow=_allowances(network._get("allow"), network.at("allow")),
        ),
        shutdown_grace_seconds=top.number("shutdown_grace_seconds", 30.0, 0, float),
        env_allowlist=top.string_list("env_allowlist", ("CI", "GITHUB_*", "RUNNER_*")),
        webhook=webhook_settings(top._get("webhook") or {}, top.at("webhook"), base),
    )
    for reader in (top, resources, artifacts, logs, retention, prewarm, network):
        reader.check_unknown()
    if config.default_timeout_seconds > config.max_timeout_seconds:
        raise ConfigError(f"{top.at('default_timeout_seconds')}: larger than max_timeout_seconds")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,8}", config.network.slot_prefix):
        raise ConfigError(f"{network.at('slot_prefix')}: 1-9 lowercase letters or digits, starting with a letter")
    if config.network.allow.rules and not config.network.enabled:
        raise ConfigError(f"{network.at('allow')}: has no effect while network.enabled is false; "
                          "enable networking or remove allow")
    if config.logs.max_entry_bytes < 1:
        raise ConfigError(f"{logs.at('max_entry_bytes')}: must be at least 1")
    return config


def load_config(path: str | Path) -> ServiceConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level")
    return config_from_mapping(data, where=f"{path}: ", base=path.parent)
