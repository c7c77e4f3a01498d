"""The service's YAML configuration, read in one pass into typed, frozen dataclasses.

Every limit the service enforces against hostile guests and clients lives here, so an operator can
read in one file what a job may cost the host. The dataclasses below are the single source of truth:
each field's default, range and help text is declared once (`setting(...)`), and both the loader and
the published JSON Schema (`json_schema()`, docs/service-config.schema.json) are derived from them.

The loader reads the file through `policy.yamldoc`, as the policy loader does: bounded size and
depth, no aliases, UTF-8 only, duplicate keys refused. A service that refuses to start must say
exactly what to fix, so every problem of the file is reported at once, each with its file:line:col
and the key, and values quoted back are cut short. Numbers must be finite and within their range:
`.inf` or `.nan` seconds would make timers that never fire or raise.
"""

from __future__ import annotations

import grp
import json
import math
import pwd
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from fractions import Fraction
from ipaddress import ip_network
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, cast

import yaml

from policy.model import PROTOCOLS, Rule, is_protocol
from policy.model import Network as IpNetwork
from policy.render import OperatorAllowances
from policy.yamldoc import (
    BOOL_TAG,
    FLOAT_TAG,
    INT_TAG,
    STR_TAG,
    Limits,
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
from runner.errors import ConfigError as ConfigError  # re-exported: the config area's base, every problem file:line
from runner.github.config import DEFAULT_LABELS
from runner.github.webhooks import DEFAULT_MAX_BODY
from runner.jobapi.contract import DEFAULT_SOCKET, REPOSITORY  # the job API's contract: one default, one pattern

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_STATE_DIR = "/var/lib/microvm-check"
LIMITS = Limits("config", 64 * 1024, 8, "a config is a mapping of settings with a few small sections",
                max_problems=20)
MAX_STRING = 4096  # characters in a path, name or token
MAX_LIST = 64  # templates, labels, env patterns
MAX_ALLOW_RULES = 256
MAX_TOKEN_FILE = 4096
MINUTE, HOUR, DAY = 60, 3600, 86400
KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4

SIZE_PATTERN = r"^\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([KMGTkmgt][iI]?[bB]?|[bB])?\s*$"
_SIZE = re.compile(SIZE_PATTERN)
_UNITS = {"": 1, "B": 1, "K": KIB, "M": MIB, "G": GIB, "T": TIB}
_INTEGER = re.compile(r"[-+]?[0-9]{1,19}")
_NON_FINITE = re.compile(r"[-+]?\.(inf|Inf|INF|nan|NaN|NAN)")
LISTEN_PATTERN = r"^.+:[0-9]{1,5}$"
# The repository names jobs and sandboxes run as are the contract's (what a submit or a create is checked
# against). JSON Schema's regexes (ECMA-262) have no \Z; there `$` ends the text, as \Z does in Python.
REPOSITORY_SCHEMA_PATTERN = "^" + REPOSITORY.pattern.replace(r"\Z", "$") + "$"
REPOSITORY_RULE = ("write owner/name: each part 1 to 100 letters, digits, '_', '.' or '-', and neither part "
                   "'.' nor '..' (e.g. my-org/my-repo)")
SLOT_PREFIX_PATTERN = r"^[a-z][a-z0-9]{0,8}$"


class SettingMeta(TypedDict):
    """A setting's declaration, kept in its dataclass field's metadata by `setting`."""

    kind: str  # how it is read (`_Walk.read_<kind>`) and described (`_KIND_SCHEMAS`)
    help: str
    minimum: float | None
    maximum: float | None
    pattern: str | None
    section: type[DataclassInstance] | None  # the dataclass of a "section" setting


def _meta(f: Field[object]) -> SettingMeta:
    """Every config field is declared with `setting`, which stores a SettingMeta as its metadata."""
    return cast(SettingMeta, f.metadata)


# A list item's own reading: a plain string.
_ITEM = SettingMeta(kind="string", help="", minimum=None, maximum=None, pattern=None, section=None)
T = TypeVar("T", bound="DataclassInstance")


def setting(default: object, help: str, kind: str, *, minimum: float | None = None, maximum: float | None = None,
            pattern: str | None = None, section: type[DataclassInstance] | None = None) -> Any:
    """A config field: its default, how it is read (`kind`), its range and what it is for, declared once.
    Returns a dataclasses.field, as loosely typed as `field()`, so each setting keeps its own annotation."""
    metadata = SettingMeta(kind=kind, help=help, minimum=minimum, maximum=maximum, pattern=pattern, section=section)
    if section is not None:
        return field(default_factory=section, metadata=metadata)
    if isinstance(default, OperatorAllowances):
        return field(default_factory=OperatorAllowances, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Resources:
    vcpus: int | None = setting(None, "vCPUs per job VM (default: the template's)", "int", minimum=1, maximum=64)
    memory_mib: int | None = setting(None, "memory per job VM in MiB (default: the template's)", "int",
                                     minimum=64, maximum=1024**2)


@dataclass(frozen=True)
class SizeClass:
    """A size a job may ask for with `size:` (where its repository's store file allows it): every offered
    template is baked at it as `<template>.<size>` (template build NAME --size SIZE), and the VM's
    cgroup limits follow its vCPUs and memory."""

    vcpus: int = setting(1, "vCPUs of this size's VMs", "int", minimum=1, maximum=64)
    memory_mib: int = setting(512, "memory of this size's VMs in MiB", "int", minimum=128, maximum=1024**2)
    disk_mib: int = setting(2048, "free space for the job in the VM's root filesystem, MiB", "int",
                            minimum=256, maximum=1024**2)


SIZE_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,31}$"  # the names a store file's `sizes:` may list (policy.warm)


@dataclass(frozen=True)
class ArtifactLimits:
    max_count: int = setting(1000, "files and directories a job may return", "int", minimum=0, maximum=10**6)
    max_total_bytes: int = setting(512 * MIB, "bytes a job's artifacts may total", "size", minimum=0, maximum=TIB)


@dataclass(frozen=True)
class LogLimits:
    max_bytes: int = setting(16 * MIB, "guest output kept per job; beyond it output is dropped with a system note",
                             "size", minimum=0, maximum=TIB)
    max_entry_bytes: int = setting(64 * KIB, "larger chunks are split so no single log entry is huge",
                                   "size", minimum=1, maximum=16 * MIB)


@dataclass(frozen=True)
class Retention:
    days: float = setting(14.0, "job records and directories older than this are pruned", "number",
                          minimum=0, maximum=36500)
    max_records: int = setting(10000, "at most this many job records are kept", "int", minimum=1, maximum=10**9)


@dataclass(frozen=True)
class Prewarm:
    max_vms: int = setting(2, "VMs restored ahead of a job announced by the webhook", "int", minimum=0, maximum=1024)
    expire_seconds: float = setting(300.0, "an unclaimed pre-warmed VM is destroyed after this", "number",
                                    minimum=1, maximum=DAY)


@dataclass(frozen=True)
class Bases:
    """Repositories' warm bases (runner/service/jobs/bases.py): built from their default branch's `warm:`
    section when GitHub App settings (github_config) let the service read it."""

    disk_budget: int = setting(20 * GIB, "disk the warm bases (and other templates made from VMs) may take "
                                         "together; the least recently used go first", "size",
                               minimum=0, maximum=64 * TIB)
    setup_timeout_seconds: float = setting(1800.0, "a base's warm.setup is stopped (and the build fails) after "
                                                   "this", "number", minimum=1, maximum=DAY)
    max_concurrent_builds: int = setting(1, "base builds at once on this host (each is a VM running a setup); "
                                            "the others wait their turn, so a template change rebuilds them one by "
                                            "one", "int", minimum=1, maximum=64)
    failure_backoff_seconds: float = setting(300.0, "after a base's build fails it is not tried again for this "
                                                    "long, doubling with each failure in a row (at most a day)",
                                             "number", minimum=0, maximum=DAY)


@dataclass(frozen=True)
class Network:
    """Per-VM networking (runner.net). Off by default: then no job VM gets a network card, and a job
    whose effective policy allows any egress is refused at submit."""

    enabled: bool = setting(False, "give job VMs a filtered network card when their policy allows egress", "bool")
    uplink_interface: str | None = setting(None, "the host's uplink (default: the default route's interface)",
                                           "string")
    slot_prefix: str = setting("mvc", "prefix of the network namespaces and interfaces (1-9 lowercase letters "
                                      "or digits, starting with a letter)", "string", pattern=SLOT_PREFIX_PATTERN)
    slots: int = setting(0, "network slots made ahead of time", "int", minimum=0, maximum=4096)
    allow: OperatorAllowances = setting(OperatorAllowances(), "operator allowances: rules (cidr, ports, protocol) "
                                        "applied to every networked VM before the always-denied destinations",
                                        "allow")
    block_list: Path | None = setting(None, "file of names and networks no job may reach in any mode, audit "
                                            "included (one a line, # comments; policy/blocklist.py)", "path")
    upstream_ca: Path | None = setting(None, "extra CA certificates (PEM file) the host trusts, besides its own store, "
                                             "when it terminates a job's TLS for methods:/paths: rules", "path")


@dataclass(frozen=True)
class WebhookSettings:
    """The GitHub webhook endpoint (`runner.service.github.webhook`); off unless `listen` is set."""

    listen: tuple[str, int] | None = setting(None, "HOST:PORT of the webhook endpoint; off when unset", "listen")
    secret_path: Path | None = setting(None, "file holding the webhook secret (required with listen)", "path")
    labels: tuple[str, ...] = setting(DEFAULT_LABELS, "runner labels whose queued jobs are pre-warmed", "strings")
    max_body: int = setting(DEFAULT_MAX_BODY, "largest delivery body accepted", "size", minimum=1, maximum=64 * MIB)
    allow_sources: tuple[str, ...] | None = setting(None, "source networks (CIDRs, e.g. GitHub's published hook "
                                                          "ranges) the endpoint serves; unset: any source", "strings")
    redeliver_every: float | None = setting(None, "seconds between sweeps asking GitHub to redeliver failed "
                                                  "deliveries (needs the App settings)", "number",
                                            minimum=30, maximum=DAY)
    github_config: Path | None = setting(None, "the GitHub App settings for the redelivery sweep", "path")


@dataclass(frozen=True)
class LocalJobs:
    """Jobs from a socket member without a runner credential (no fleet, no registered runner): they run
    under one repository name the operator chooses, and so under that name's policy, never under
    a repository name the client sends (runner/service/jobs/auth.py)."""

    repository: str | None = setting(None, "owner/name such jobs run as (its policy store file gives their egress); "
                                           "unset: a socket member without a runner credential may not submit",
                                     "repository")


@dataclass(frozen=True)
class SandboxAccess:
    """Interactive sandboxes (runner/service/jobs/sandboxes.py, the `microvm_check` SDK): who may create them on
    the Unix socket, as which repository (its policy store file is the most their egress gets; a
    sandbox's own policy only narrows it) and how many, how long and how large. Off unless `group` is
    set; the operator (root, admin_group, the TCP token) may always create them."""

    group: str | None = setting(None, "unix group whose members may create sandboxes on the socket (a bot's "
                                      "user in it); unset: only the operator may", "string")
    repository: str = setting("sandbox/sandbox", "owner/name the sandboxes run as: its policy store file is the "
                                                 "egress they may get at most", "repository")
    max_live: int = setting(4, "sandboxes alive at once on this host", "int", minimum=0, maximum=1024)
    max_per_caller: int = setting(2, "sandboxes one caller (uid, or the operator) holds at once", "int",
                                  minimum=1, maximum=1024)
    max_ttl_seconds: float = setting(3600.0, "the longest life a sandbox may ask for; the service destroys it "
                                             "then, whatever its caller does", "number", minimum=10, maximum=DAY)
    exec_timeout_seconds: float = setting(600.0, "the longest one exec may run", "number", minimum=1, maximum=DAY)
    exec_output_bytes: int = setting(16 * MIB, "output one exec streams back; beyond it the command is killed",
                                     "size", minimum=1, maximum=GIB)
    file_max_bytes: int = setting(64 * MIB, "largest file written, read, uploaded or downloaded in one call",
                                  "size", minimum=1, maximum=16 * GIB)
    max_snapshots: int = setting(2, "snapshots (fork sources) one sandbox may make; each is removed with it",
                                 "int", minimum=0, maximum=64)


RUNNER_NAME_PREFIX_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$"
RUNNER_USER_PATTERN = r"^[a-z_][a-z0-9_-]{0,31}$"


@dataclass(frozen=True)
class RunnerSettings:
    """Ephemeral GitHub runners this host keeps (`runner.fleet`); off unless `org` is set.

    Each runner is registered just in time, takes one job and is deleted with its directory; the
    service keeps `min_idle` of them waiting and never more than `max_runners`."""

    org: str | None = setting(None, "organisation whose just-in-time runners this host runs; off when unset",
                              "string")
    github_config: Path | None = setting(None, "the GitHub App settings that register the runners (default: the "
                                               "service's github_config)", "path")
    labels: tuple[str, ...] = setting(DEFAULT_LABELS, "labels of this host's runners (one set per host class)",
                                      "strings")
    runner_group: int = setting(1, "runner group ID the runners join (1: the org's Default group)", "int",
                                minimum=1, maximum=2**31)
    min_idle: int = setting(1, "idle runners kept waiting for a job", "int", minimum=0, maximum=1024)
    max_runners: int | None = setting(None, "runners at once, idle or busy (default: max_concurrent_jobs)", "int",
                                      minimum=1, maximum=1024)
    idle_recycle_seconds: float = setting(3600.0, "a runner that got no job in this time is replaced by a fresh "
                                                  "one", "number", minimum=10, maximum=7 * DAY)
    shutdown_grace_seconds: float = setting(300.0, "at shutdown, busy runners get this long to finish their job",
                                            "number", minimum=0, maximum=DAY)
    job_timeout_seconds: float = setting(6 * 3600.0, "a busy runner's job may take this long (GitHub's own limit "
                                                     "for a job: 6 h); past it plus deadline_grace_seconds the "
                                                     "runner is killed, with all its job started, and what its "
                                                     "job runs in the service fails", "number",
                                         minimum=1, maximum=7 * DAY)
    deadline_grace_seconds: float = setting(300.0, "added to job_timeout_seconds before a busy runner is killed",
                                            "number", minimum=0, maximum=DAY)
    network: str = setting("host", "the runners' network: host (the host's, shared), or none (a namespace of its "
                                   "own with nothing in it: the job API's Unix socket only; runner/fleet/walls.py)",
                           "string", pattern=r"^(host|none)$")
    memory_mib: int = setting(4096, "memory one runner may use, its host-side steps' processes and its private "
                                    "tmpfs files included (MiB)", "int", minimum=64, maximum=1024 * 1024)
    cpu_weight: int = setting(100, "one runner's share of the CPU against the others (cgroup v2 cpu.weight: 1-10000)",
                              "int", minimum=1, maximum=10000)
    runner_user: str = setting("microvm-check-runner", "the unprivileged user the runners run as (never root)",
                               "string", pattern=RUNNER_USER_PATTERN)
    install_dir: Path = setting(Path("/opt/microvm-check/actions-runner"), "where `microvm-check runner install` "
                                "unpacked the runner release (read-only to runners)", "path")
    runners_dir: Path = setting(Path("/var/lib/microvm-check-runners"), "parent of the runners' own directories, "
                                "each made fresh for one job and deleted after it", "path")
    name_prefix: str | None = setting(None, "prefix of this host's runner names, which tells its runners from other "
                                            "hosts' (default: mvc-<host name>)", "string",
                                      pattern=RUNNER_NAME_PREFIX_PATTERN)


@dataclass(frozen=True)
class ServiceConfig:
    socket: str = setting(DEFAULT_SOCKET, "the job API's Unix socket", "string")
    socket_group: str | None = setting(None, "the group allowed to use the socket (mode 0660)", "string")
    admin_group: str | None = setting(None, "members (and root) are the operator on the socket: they list all jobs "
                                            "and reach any job (runner/service/jobs/auth.py)", "string")
    attach_group: str | None = setting(None, "members (besides the operator) may attach a terminal to a running "
                                             "job's VM (jobs attach, jobs exec); never a runner's user", "string")
    listen: tuple[str, int] | None = setting(None, "optional TCP HOST:PORT for the job API, the jobs page "
                                                   "(/ui) and /metrics (docs/operating.md); needs token or "
                                                   "token_file", "listen")
    token: str | None = setting(None, "bearer token for TCP clients, the jobs page's ?token= login and "
                                             "/metrics (at least 16 characters)", "string")
    token_file: Path | None = setting(None, "file holding the bearer token, instead of token", "path")
    state_dir: Path = setting(Path(DEFAULT_STATE_DIR), "job directories, records and the VM engine's root", "path")
    attestation_key: Path | None = setting(None, "the Ed25519 key job records are signed with, made on first start "
                                                 "(0600); default: <state_dir>/attestation-key.pem", "path")
    public_url: str | None = setting(None, "where maintainers reach this service's job pages (https://host:port); "
                                           "a job's check run links <public_url>/ui/jobs/<id>", "string",
                                     pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")
    templates: tuple[str, ...] = setting(("base",), "offered templates; the first is the default", "strings")
    resources: Resources = setting(None, "job VM size", "section", section=Resources)
    sizes: dict[str, SizeClass] | None = setting(None, "size classes a job may ask for (size: NAME), each "
                                                       "name: {vcpus, memory_mib, disk_mib}; a repository "
                                                       "gets only those its store file's sizes: lists", "sizes")
    max_concurrent_jobs: int = setting(2, "VMs running jobs at once (worker threads)", "int", minimum=1, maximum=1024)
    max_queued_jobs: int = setting(32, "submitted but not started jobs (incl. awaiting checkout); 429 beyond",
                                   "int", minimum=1, maximum=100000)
    max_queued_per_repository: int | None = setting(None, "of max_queued_jobs, the most one repository's runner "
                                                          "jobs hold (default: half, at least 1)", "int", minimum=1,
                                                    maximum=100000)
    max_queued_per_runner: int = setting(2, "queue slots one fleet runner holds (it runs one GitHub job)", "int",
                                         minimum=1, maximum=100000)
    max_running_per_repository: int | None = setting(None, "VMs one repository runs at once (default: "
                                                           "max_concurrent_jobs; the fewest-running goes first "
                                                           "anyway)", "int", minimum=1, maximum=1024)
    checkout_max_bytes: int = setting(GIB, "largest checkout tar accepted", "size", minimum=1, maximum=TIB)
    checkout_wait_seconds: float = setting(600.0, "a submitted job whose checkout never comes is dropped after "
                                                  "this", "number", minimum=1, maximum=7 * DAY)
    default_timeout_seconds: int = setting(HOUR, "a job's timeout when its spec names none", "int",
                                           minimum=1, maximum=7 * DAY)
    max_timeout_seconds: int = setting(6 * HOUR, "the largest timeout a job may ask for", "int",
                                       minimum=1, maximum=7 * DAY)
    artifacts: ArtifactLimits = setting(None, "artifact limits", "section", section=ArtifactLimits)
    logs: LogLimits = setting(None, "log limits", "section", section=LogLimits)
    policy_dir: Path | None = setting(None, "the policy store (policy.PolicyStore layout); without it: deny all",
                                      "path")
    github_config: Path | None = setting(None, "GitHub App settings: policies from the repositories' default "
                                               "branches", "path")
    retention: Retention = setting(None, "how long job records are kept", "section", section=Retention)
    prewarm: Prewarm = setting(None, "VMs restored ahead of jobs the webhook announces", "section", section=Prewarm)
    bases: Bases = setting(None, "repositories' warm bases: their disk budget and setup timeout", "section",
                           section=Bases)
    network: Network = setting(None, "per-VM networking", "section", section=Network)
    secrets: Path | None = setting(None, "the operator's secret bindings (docs/secrets.md): which repositories' jobs "
                                         "get a placeholder the host swaps for a value from a root-only file, and "
                                         "where it may be sent", "path")
    shutdown_grace_seconds: float = setting(30.0, "at shutdown, running jobs get this long before they are "
                                                  "cancelled", "number", minimum=0, maximum=DAY)
    env_allowlist: tuple[str, ...] = setting(("CI", "GITHUB_*", "RUNNER_*"), "environment names (globs) a job "
                                             "spec may set", "strings")
    webhook: WebhookSettings = setting(None, "the GitHub webhook endpoint", "section", section=WebhookSettings)
    log_format: str = setting("text", "the service log's format: text, or json (one object per line; job events "
                                      "carry their job id)", "string", pattern=r"^(text|json)$")
    log_level: str = setting("info", "the service log's level: debug, info (job lifecycle events), warning or error",
                             "string", pattern=r"^(debug|info|warning|error)$")
    runners: RunnerSettings = setting(None, "ephemeral GitHub runners kept by the service", "section",
                                      section=RunnerSettings)
    local_jobs: LocalJobs = setting(None, "jobs of socket members without a runner credential", "section",
                                    section=LocalJobs)
    sandboxes: SandboxAccess = setting(None, "interactive sandboxes for SDK clients (review bots, audit agents)",
                                       "section", section=SandboxAccess)

    @property
    def default_template(self) -> str:
        return self.templates[0]

    def size(self, name: str) -> SizeClass:
        """The size class `name`; KeyError when the config offers none of that name."""
        return (self.sizes or {})[name]

    @property
    def size_labels(self) -> tuple[str, ...]:
        """The runner labels that say which size classes this host offers (`runs-on: [self-hosted,
        size-large]` finds a host that has `large`): the fleet registers its runners with them."""
        return tuple(f"size-{name}" for name in self.sizes or {})

    @property
    def jobs_dir(self) -> Path:
        return self.state_dir / "jobs"

    @property
    def records_path(self) -> Path:
        return self.state_dir / "jobs.sqlite"

    @property
    def attestation_key_path(self) -> Path:
        return self.attestation_key or self.state_dir / "attestation-key.pem"


# -- reading --------------------------------------------------------------------------------------


def load_config(path: str | Path) -> ServiceConfig:
    """The config in the file at `path`; raises `ConfigError` with every problem, never anything else."""
    path = Path(path)
    problems = Problems(str(path), LIMITS.max_problems)
    text = read_text(path, LIMITS, problems)
    node = compose(text, LIMITS, problems) if text is not None else None
    if problems.items:
        raise ConfigError(sort_problems(problems.final()))
    return _build(node, problems, path.parent)


def config_from_mapping(data: dict[str, object], where: str = "<config>", base: Path = Path(".")) -> ServiceConfig:
    """A config from Python values (tests, `run`, benchmarks), checked exactly like a file.
    `where` names the source in messages, `base` resolves relative paths."""
    problems = Problems(where, LIMITS.max_problems)
    return _build(_to_node(data, problems), problems, base)


def webhook_from_mapping(data: dict[str, object], base: Path = Path(".")) -> WebhookSettings:
    """A `webhook:` section from Python values, checked like the one in a config file."""
    problems = Problems("<webhook settings>")
    walk = _Walk(problems, base)
    node = _to_node(data, problems)
    settings = walk.section(WebhookSettings, node, "webhook.") if not problems.items else None
    if settings is not None:
        _check_webhook(settings, walk, "webhook.")
    if problems.items or settings is None:
        raise ConfigError(sort_problems(problems.final()))
    return settings


def _build(node: yaml.Node | None, problems: Problems, base: Path) -> ServiceConfig:
    walk = _Walk(problems, base)
    config = walk.section(ServiceConfig, node, "") if not problems.items else None
    if config is not None:
        config = _check(config, walk)
    if problems.items or config is None:
        raise ConfigError(sort_problems(problems.final()))
    return config


class _Representer(yaml.representer.SafeRepresenter):
    """Python values as YAML nodes (without marks), so `config_from_mapping` checks them like a file."""


_Representer.add_multi_representer(PurePath, lambda r, value: r.represent_str(str(value)))
_Representer.add_representer(tuple, lambda r, value: r.represent_list(list(value)))


def _to_node(data: object, problems: Problems) -> yaml.Node | None:
    representer = _Representer(sort_keys=False)
    try:
        return representer.represent_data(data)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        problems.add(None, f"the config cannot be read as settings: {quote(str(exc), 200)}")
        return None


class _Walk:
    """One pass over the node tree, guided by the dataclasses' fields; remembers each key's node so
    that checks spanning several settings can point at a line too."""

    def __init__(self, problems: Problems, base: Path) -> None:
        self.problems = problems
        self.base = base
        self.nodes: dict[str, yaml.Node] = {}

    def problem(self, node: yaml.Node | None, where: str, message: str) -> None:
        self.problems.add(node.start_mark if node is not None else None, f"{where}: {message}")

    def at(self, where: str, message: str) -> None:
        """A problem with the setting at dotted path `where`, at its line when the file has it."""
        self.problem(self.nodes.get(where), where, message)

    def section(self, cls: type[T], node: yaml.Node | None, prefix: str) -> T | None:
        """An instance of `cls` from a mapping node; None after reporting problems."""
        if node is None or is_null(node):
            given: dict[str, yaml.Node] = {}
        elif not isinstance(node, yaml.MappingNode):
            where = prefix.rstrip(".") or "the config"
            self.problem(node, where, f"expected a mapping of settings (key: value), not {kind(node)}")
            return None
        else:
            known = tuple(f.name for f in fields(cls))
            escaped = prefix.replace("{", "{{").replace("}", "}}")
            given, _ = mapping(node, known, prefix.rstrip(".") or "the config", self.problems,
                               unknown=escaped + "{name}: unknown setting (a typo?); {hint}")
        before = len(self.problems.items) + self.problems.dropped
        values: dict[str, Any] = {}  # each its own field's type, which the reader of its kind returns
        for f in fields(cls):
            value_node = given.get(f.name)
            if value_node is not None:
                self.nodes[prefix + f.name] = value_node
            values[f.name] = self.value(f, value_node, prefix + f.name)
        if len(self.problems.items) + self.problems.dropped != before:
            return None
        return cls(**values)

    def value(self, f: Field[object], node: yaml.Node | None, where: str) -> object:
        meta = _meta(f)
        if meta["section"] is not None:  # kind "section"
            return self.section(meta["section"], node, where + ".")
        if node is None or is_null(node):
            return _default(f)
        reader = getattr(self, "read_" + meta["kind"])
        value = reader(node, where, meta)
        if value is not None and meta["kind"] in ("int", "number", "size"):
            self.check_range(node, where, value, meta)
        return value

    def check_range(self, node: yaml.Node, where: str, value: float, meta: SettingMeta) -> None:
        low, high = meta["minimum"], meta["maximum"]
        if low is not None and value < low:
            self.problem(node, where, f"must be at least {_number(low)}, not {_number(value)}")
        elif high is not None and value > high:
            self.problem(node, where, f"must be at most {_number(high)}, not {_number(value)}")

    def read_int(self, node: yaml.Node, where: str, meta: SettingMeta) -> int | None:
        if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG and _INTEGER.fullmatch(node.value):
            return int(node.value)
        self.problem(node, where, f"expected an integer in plain decimal digits, not {kind(node)}")
        return None

    def read_number(self, node: yaml.Node, where: str, meta: SettingMeta) -> float | None:
        if isinstance(node, yaml.ScalarNode) and node.tag == FLOAT_TAG and _NON_FINITE.fullmatch(node.value):
            self.problem(node, where, f"must be a finite number, not {kind(node)}")
            return None
        if isinstance(node, yaml.ScalarNode) and node.tag in (INT_TAG, FLOAT_TAG) and len(node.value) <= 40:
            try:
                value = float(node.value.replace("_", ""))
            except ValueError:
                value = math.nan
            if math.isfinite(value):
                return value
        self.problem(node, where, f"expected a number, not {kind(node)}")
        return None

    def read_size(self, node: yaml.Node, where: str, meta: SettingMeta) -> int | None:
        if isinstance(node, yaml.ScalarNode) and node.tag in (INT_TAG, STR_TAG):
            try:
                return parse_size(node.value)
            except ValueError:
                pass
        self.problem(node, where, f"expected a size like 512MiB, 1.5GiB or 1G (whole bytes), not {kind(node)}")
        return None

    def read_bool(self, node: yaml.Node, where: str, meta: SettingMeta) -> bool | None:
        if isinstance(node, yaml.ScalarNode) and node.tag == BOOL_TAG:
            return yaml.constructor.SafeConstructor.bool_values[node.value.lower()]
        self.problem(node, where, f"expected true or false, not {kind(node)}")
        return None

    def read_string(self, node: yaml.Node, where: str, meta: SettingMeta) -> str | None:
        value = string(node)
        if value is None:
            hint = " (put it in quotes)" if isinstance(node, yaml.ScalarNode) else ""
            self.problem(node, where, f"expected a string{hint}, not {kind(node)}")
            return None
        error = _string_error(value)
        pattern = meta["pattern"]
        if error is None and pattern and not re.fullmatch(pattern.strip("^$"), value):
            error = f"{quote(value)} does not fit: {meta['help']}"
        if error:
            self.problem(node, where, error)
            return None
        return value

    def read_repository(self, node: yaml.Node, where: str, meta: SettingMeta) -> str | None:
        """An owner/name by the contract's pattern: one the service's own calls would refuse (a submit or a
        create answered 400, as if the caller had named it) is refused here, before the service starts."""
        value = self.read_string(node, where, meta)
        if value is None or REPOSITORY.fullmatch(value):
            return value
        self.problem(node, where, f"{quote(value)} is not a repository name; {REPOSITORY_RULE}")
        return None

    def read_path(self, node: yaml.Node, where: str, meta: SettingMeta) -> Path | None:
        value = self.read_string(node, where, meta)
        if value is None:
            return None
        try:
            return (self.base / value).resolve()
        except (OSError, RuntimeError, ValueError) as exc:
            self.problem(node, where, f"cannot use the path {quote(value)}: {quote(str(exc), 100)}")
            return None

    def read_strings(self, node: yaml.Node, where: str, meta: SettingMeta) -> tuple[str, ...] | None:
        if not isinstance(node, yaml.SequenceNode) or not node.value or len(node.value) > MAX_LIST:
            self.problem(node, where, f"expected a list of 1 to {MAX_LIST} strings, not {_shape(node)}")
            return None
        items = [self.read_string(item, f"{where}[{index}]", _ITEM) for index, item in enumerate(node.value)]
        strings = [item for item in items if item is not None]
        return tuple(strings) if len(strings) == len(items) else None

    def read_sizes(self, node: yaml.Node, where: str, meta: SettingMeta) -> dict[str, SizeClass] | None:
        if not isinstance(node, yaml.MappingNode) or not node.value or len(node.value) > MAX_LIST:
            self.problem(node, where, f"expected a mapping of 1 to {MAX_LIST} size classes (name: {{vcpus, "
                                      f"memory_mib, disk_mib}}), not {_shape(node)}")
            return None
        sizes: dict[str, SizeClass] = {}
        for key, value in node.value:
            name = string(key)
            if name is None or not re.fullmatch(SIZE_NAME_PATTERN.strip("^$"), name):
                self.problem(key, where, f"{quote(str(key.value))} is not a size name (lowercase letters, digits, "
                                         "'-'; up to 32)")
                continue
            if name in sizes:
                self.problem(key, f"{where}.{name}", "given twice")
                continue
            found = self.section(SizeClass, value, f"{where}.{name}.")
            if found is not None:
                sizes[name] = found
        return sizes if len(sizes) == len(node.value) else None

    def read_listen(self, node: yaml.Node, where: str, meta: SettingMeta) -> tuple[str, int] | None:
        value = self.read_string(node, where, meta)
        if value is None:
            return None
        try:
            return parse_listen(value)
        except ValueError as exc:
            self.problem(node, where, str(exc))
            return None

    def read_allow(self, node: yaml.Node, where: str, meta: SettingMeta) -> OperatorAllowances | None:
        """`network.allow`: the operator's network rules, applied to every networked VM before the
        always-denied destinations, so they alone can open e.g. a proxy on the host or the metadata service."""
        if not isinstance(node, yaml.SequenceNode) or len(node.value) > MAX_ALLOW_RULES:
            self.problem(node, where, f"expected a list of at most {MAX_ALLOW_RULES} rules like "
                                      f"{{cidr: 10.0.0.5/32, ports: [3128]}}, not {_shape(node)}")
            return None
        items = [self.allowance(item, f"{where}[{index}]") for index, item in enumerate(node.value)]
        rules = [rule for rule in items if rule is not None]
        return OperatorAllowances(tuple(rules)) if len(rules) == len(items) else None

    def allowance(self, node: yaml.Node, where: str) -> Rule | None:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, where, f"expected a mapping with cidr, ports and protocol, not {kind(node)}")
            return None
        before = len(self.problems.items)
        given, _ = mapping(node, ("cidr", "ports", "protocol"), where, self.problems,
                           unknown=where.replace("{", "{{") + ".{name}: unknown key; a rule has cidr, ports and "
                                                              "protocol (no host names here)")
        network = self.rule_cidr(given.get("cidr"), node, where)
        ports = self.rule_ports(given.get("ports"), node, where)
        protocol = string(given["protocol"]) if "protocol" in given else "tcp"
        if not is_protocol(protocol):
            self.problem(given["protocol"], f"{where}.protocol", f"use tcp or udp, not {kind(given['protocol'])}")
            return None
        if len(self.problems.items) != before or network is None or ports is None:
            return None
        return Rule(frozenset(ports), protocol, network=network)

    def rule_cidr(self, node: yaml.Node | None, rule: yaml.Node, where: str) -> IpNetwork | None:
        if node is None:
            self.problem(rule, f"{where}.cidr", "missing; give a network like 169.254.169.254/32")
            return None
        value = string(node)
        try:
            return ip_network(value or "", strict=True)
        except ValueError as exc:
            self.problem(node, f"{where}.cidr", f"{quote(str(exc), 100)}; give a network like 169.254.169.254/32")
            return None

    def rule_ports(self, node: yaml.Node | None, rule: yaml.Node, where: str) -> list[int] | None:
        if not isinstance(node, yaml.SequenceNode) or not 1 <= len(node.value) <= 128:
            self.problem(node if node is not None else rule, f"{where}.ports",
                         f"expected a list of 1 to 128 port numbers like [80, 443], not "
                         f"{_shape(node) if node is not None else 'nothing'}")
            return None
        ports = []
        for item in node.value:
            port = decimal_int(item)
            if port is None or not 1 <= port <= 65535:
                self.problem(item, f"{where}.ports", f"{kind(item)} is not a port number (1..65535)")
            else:
                ports.append(port)
        return ports if len(ports) == len(node.value) else None


def _check(config: ServiceConfig, walk: _Walk) -> ServiceConfig | None:
    """What one setting alone cannot say: settings that need or exclude each other, the token file."""
    token = config.token
    if config.token and config.token_file:
        walk.at("token", "set either token or token_file, not both")
    elif config.token_file:
        token = _read_token(config.token_file, walk)
    if config.listen and (not token or len(token) < 16):
        walk.at("listen", "TCP needs a bearer token of at least 16 characters (token or token_file)")
    if config.default_timeout_seconds > config.max_timeout_seconds:
        walk.at("default_timeout_seconds", f"larger than max_timeout_seconds ({config.max_timeout_seconds})")
    if config.network.allow.rules and not config.network.enabled:
        walk.at("network.allow", "has no effect while network.enabled is false; enable networking or remove allow")
    _check_webhook(config.webhook, walk, "webhook.")
    _check_runners(config, walk)
    _check_sandbox_group(config, walk)
    _check_sizes_fit(config, walk)
    return replace(config, token=token)


def _check_webhook(settings: WebhookSettings, walk: _Walk, prefix: str) -> None:
    if settings.listen and not settings.secret_path:
        walk.at(prefix + "listen", f"{prefix}secret_path: required when listen is set "
                                   "(a file holding the webhook secret)")


def _check_runners(config: ServiceConfig, walk: _Walk) -> None:
    runners = config.runners
    if runners.org is None:
        return
    if runners.runner_user == "root":
        walk.at("runners.runner_user", "runners never run as root: name an unprivileged user of their own")
    if runners.github_config is None and config.github_config is None:
        walk.at("runners.org", "registering runners needs the GitHub App settings: set runners.github_config "
                               "or github_config")
    most = runners.max_runners or config.max_concurrent_jobs
    if runners.min_idle > most:
        walk.at("runners.min_idle", f"larger than max_runners ({most}): at most that many runners exist at once")


def _check_sandbox_group(config: ServiceConfig, walk: _Walk) -> None:
    """Sandboxes' creators are never the socket's users at large nor the fleet's runner user: a runner runs
    a fork's own steps on the host, and a sandbox outlives the job with the sandboxes' repository's egress."""
    group = config.sandboxes.group
    if group is None:
        return
    if group == config.socket_group:
        walk.at("sandboxes.group", f"is socket_group ({quote(group)}), which the runners' user is in (docs/fleet.md): "
                                   "name a group of the sandbox callers (a bot's user) alone")
        return
    if config.runners.org is None:
        return
    user = config.runners.runner_user
    try:
        members = grp.getgrnam(group)
    except KeyError:
        return  # no such group yet: nobody is in it
    try:
        primary = pwd.getpwnam(user).pw_gid
    except KeyError:
        primary = None
    if user in members.gr_mem or primary == members.gr_gid:
        walk.at("sandboxes.group", f"group {quote(group)} holds the runners' user {quote(user)} (runners.runner_user): "
                                   "a fork's workflow step could create sandboxes; take the user out of the group")


HOST_RESERVE_MIB = 1024  # of the host's memory, kept for the service, the kernel and the runners' own steps


def _check_sizes_fit(config: ServiceConfig, walk: _Walk) -> None:
    """max_concurrent_jobs VMs of the largest size class, each at its cgroup's memory limit (the guest's
    RAM plus QEMU's own, runner/vm/cgroup.py), must fit in this host's memory less a reserve: a class
    that cannot run as many jobs at once as the config admits is refused here, not found by the OOM killer."""
    if not config.sizes:
        return
    from runner.vm.cgroup import limits_for
    from runner.vm.memory import host_memory_mib

    host = host_memory_mib()
    if host is None:
        return
    name, largest = max(config.sizes.items(), key=lambda item: item[1].memory_mib)
    per_vm = limits_for(largest.vcpus, largest.memory_mib).memory_bytes >> 20
    need = config.max_concurrent_jobs * per_vm
    if need > host - HOST_RESERVE_MIB:
        most = max(0, (host - HOST_RESERVE_MIB) // per_vm)
        walk.at(f"sizes.{name}", f"max_concurrent_jobs ({config.max_concurrent_jobs}) VMs of this size need "
                                 f"{need} MiB ({per_vm} MiB each: memory_mib plus QEMU's own), more than this host's "
                                 f"{host} MiB less {HOST_RESERVE_MIB} MiB for the host: lower memory_mib, or "
                                 f"max_concurrent_jobs to {most} or fewer")


def _read_token(path: Path, walk: _Walk) -> str | None:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_TOKEN_FILE + 1)
    except OSError as exc:
        walk.at("token_file", f"cannot read {quote(str(path), 200)}: {exc.strerror}")
        return None
    if len(data) > MAX_TOKEN_FILE:
        walk.at("token_file", f"{quote(str(path), 200)} is larger than {MAX_TOKEN_FILE} bytes; it should hold one token")
        return None
    try:
        return data.decode("ascii").strip()
    except UnicodeDecodeError:
        walk.at("token_file", f"{quote(str(path), 200)} is not ASCII text")
        return None


def parse_size(text: str) -> int:
    """`1048576`, `"512MiB"`, `"1.5GiB"`, `"1G"` as bytes: operators write sizes by hand, and decimals
    as they think of them. Units are binary (K = KiB). ValueError otherwise, also for a fraction of a byte."""
    match = _SIZE.match(text)
    size = Fraction(match.group(1)) * _UNITS[(match.group(2) or "").upper().rstrip("B").rstrip("I")] if match else None
    if size is None or size.denominator != 1:
        raise ValueError(f"expected a size like 512MiB, 1.5GiB or 1G (whole bytes), not {quote(text)}")
    return int(size)


def parse_listen(value: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8470` for IPv6) as (host, port); ValueError with the fix otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT like 127.0.0.1:8470, not {quote(value)}")
    return host.strip("[]"), int(port)


def _string_error(value: str) -> str | None:
    if not value:
        return "must not be empty"
    if len(value) > MAX_STRING:
        return f"longer than {MAX_STRING} characters: {quote(value)}"
    if "\0" in value:
        return f"contains a NUL character: {quote(value)}"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return f"is not valid Unicode text: {quote(value)}"
    return None


def _shape(node: yaml.Node) -> str:
    if isinstance(node, yaml.SequenceNode):
        return f"a list of {len(node.value)}"
    return kind(node)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# -- the JSON Schema for editors ------------------------------------------------------------------

JSONSchema = dict[str, object]  # a JSON Schema (sub)document, as json.dumps writes it


def json_schema() -> JSONSchema:
    """The config's JSON Schema, from the same dataclasses the loader walks (docs/service-config.schema.json).
    Null is allowed wherever the loader reads it as "the default". What spans settings (token with
    listen, default vs max timeout, allow without networking) only the loader checks."""
    schema = _section_schema(ServiceConfig)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": "microvm-check service config (microvm-check serve --config FILE)", **schema}


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2) + "\n"


def _section_schema(cls: type[DataclassInstance]) -> JSONSchema:
    doc = (cls.__doc__ or "").split("\n\n")[0].replace("\n", " ").strip()
    properties = {f.name: _nullable(_field_schema(f)) for f in fields(cls)}
    schema: JSONSchema = {"type": ["object", "null"], "additionalProperties": False, "properties": properties}
    if doc and not doc.startswith(cls.__name__ + "("):
        schema["description"] = doc
    return schema


def _field_schema(f: Field[object]) -> JSONSchema:
    meta = _meta(f)
    if meta["section"] is not None:  # kind "section"
        return {**_section_schema(meta["section"]), "description": meta["help"]}
    schema = {**_KIND_SCHEMAS[meta["kind"]](meta), "description": meta["help"]}
    default = _json_default(f.default)
    if default is not None:
        schema["default"] = default
    return schema


def _bounds(meta: SettingMeta) -> JSONSchema:
    return {key: meta[key] for key in ("minimum", "maximum") if meta[key] is not None}


def _string_schema(meta: SettingMeta) -> JSONSchema:
    schema: JSONSchema = {"type": "string", "minLength": 1, "maxLength": MAX_STRING}
    if meta["pattern"]:
        schema["pattern"] = meta["pattern"]
    return schema


_KIND_SCHEMAS: dict[str, Callable[[SettingMeta], JSONSchema]] = {  # JSON Schema of each kind
    "int": lambda meta: {"type": "integer", **_bounds(meta)},
    "number": lambda meta: {"type": "number", **_bounds(meta)},
    "size": lambda meta: {"oneOf": [{"type": "integer", **_bounds(meta)}, {"type": "string", "pattern": SIZE_PATTERN}]},
    "bool": lambda meta: {"type": "boolean"},
    "string": _string_schema,
    "path": _string_schema,
    "repository": lambda meta: {"type": "string", "pattern": REPOSITORY_SCHEMA_PATTERN},
    "strings": lambda meta: {"type": "array", "minItems": 1, "maxItems": MAX_LIST,
                             "items": {"type": "string", "minLength": 1, "maxLength": MAX_STRING}},
    "listen": lambda meta: {"type": "string", "pattern": LISTEN_PATTERN},
    "sizes": lambda meta: {"type": "object", "minProperties": 1, "maxProperties": MAX_LIST,
                           "propertyNames": {"pattern": SIZE_NAME_PATTERN},
                           "additionalProperties": _section_schema(SizeClass)},
    "allow": lambda meta: {"type": "array", "maxItems": MAX_ALLOW_RULES, "items": {
        "type": "object", "additionalProperties": False, "required": ["cidr", "ports"], "properties": {
            "cidr": {"type": "string", "description": "a network like 169.254.169.254/32"},
            "ports": {"type": "array", "minItems": 1, "maxItems": 128,
                      "items": {"type": "integer", "minimum": 1, "maximum": 65535}},
            "protocol": {"enum": sorted(PROTOCOLS), "default": "tcp"}}}},
}


def _nullable(schema: JSONSchema) -> JSONSchema:
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    if "type" in schema:
        return schema
    return {"anyOf": [{"type": "null"}, {k: v for k, v in schema.items() if k not in ("description", "default")}],
            **{k: v for k, v in schema.items() if k in ("description", "default")}}


def _default(f: Field[object]) -> object:
    """A setting's default: its value, or a fresh one from its factory (`setting` gives it one of the two)."""
    if f.default is not MISSING:
        return f.default
    assert callable(f.default_factory), f"setting {f.name} has no default"
    return f.default_factory()


def _json_default(value: object) -> object:
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, (bool, int, float, str)):
        return value
    return None
