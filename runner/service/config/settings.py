"""The service's settings: every limit the service enforces against hostile guests and clients, in one
file an operator can read to learn what a job may cost the host.

The dataclasses below are the single source of truth: each field's default, range and help text is
declared once (`setting(...)`), and the machinery is derived from them, in modules of its own so that
this one stays what an operator reads: the loader walks them (reading.py: the YAML walk, every problem
with its file:line), the settings that need or exclude each other are checked after it (checks.py), and
the published JSON Schema is generated from them (schema.py, docs/service-config.schema.json).
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

from policy.render import OperatorAllowances
from runner.github.config import DEFAULT_LABELS
from runner.github.webhooks import DEFAULT_MAX_BODY
from runner.jobapi.contract import DEFAULT_SOCKET  # the job API's contract: the one default socket

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_STATE_DIR = "/var/lib/microvm-check"
MAX_STRING = 4096  # characters in a path, name or token
MAX_LIST = 64  # templates, labels, env patterns
MAX_ALLOW_RULES = 256
MINUTE, HOUR, DAY = 60, 3600, 86400
KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4

SIZE_PATTERN = r"^\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([KMGTkmgt][iI]?[bB]?|[bB])?\s*$"
SLOT_PREFIX_PATTERN = r"^[a-z][a-z0-9]{0,8}$"


class SettingMeta(TypedDict):
    """A setting's declaration, kept in its dataclass field's metadata by `setting`."""

    kind: str  # how it is read (reading.py: `Walk.read_<kind>`) and described (schema.py)
    help: str
    minimum: float | None
    maximum: float | None
    pattern: str | None
    section: type[DataclassInstance] | None  # the dataclass of a "section" setting


def setting_meta(f: Field[object]) -> SettingMeta:
    """Every config field is declared with `setting`, which stores a SettingMeta as its metadata."""
    return cast(SettingMeta, f.metadata)


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


# `resources:`, the VM size of a job that names none (a size class is SizeClass; the size a VM is given is
# runner.sandbox.port.Resources). No docstring: a section's docstring would be its schema's description.
@dataclass(frozen=True)
class ResourceSettings:
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


# `retention:`, how long job records are kept (what expires them is runner.service.host.retention.Retention).
@dataclass(frozen=True)
class RetentionSettings:
    days: float = setting(14.0, "job records and directories older than this are pruned", "number",
                          minimum=0, maximum=36500)
    max_records: int = setting(10000, "at most this many job records are kept", "int", minimum=1, maximum=10**9)


@dataclass(frozen=True)
class Prewarm:
    max_vms: int = setting(2, "VMs restored ahead of a job announced by the webhook", "int", minimum=0, maximum=1024)
    expire_seconds: float = setting(300.0, "an unclaimed pre-warmed VM is destroyed after this", "number",
                                    minimum=1, maximum=DAY)


@dataclass(frozen=True)
class Images:
    """How `template build` reaches registries for image templates (docs/images.md): skopeo's own
    files, so mirrors, plain-HTTP registries and credentials are configured the way containers/image
    documents them, and nothing of ours re-implements them."""

    registries_conf: Path | None = setting(None, "a containers-registries.conf(5) file: mirrors, registries "
                                                 "reached over plain HTTP (insecure = true), short names refused",
                                           "path")
    authfile: Path | None = setting(None, "a containers-auth.json(5) file with the registries' credentials "
                                          "(root-only; skopeo reads it, nothing else does)", "path")
    disk_budget: int = setting(40 * GIB, "disk the image templates may take together; a build that would pass it "
                                         "is refused before its snapshots are baked (template rm frees room)", "size",
                               minimum=0, maximum=1024 * TIB)


@dataclass(frozen=True)
class DebugKeep:
    """Keeping the VM of a failed or timed-out job for the operator to attach to (docs/debugging.md): asked
    for by the repository's trusted file (`debug:`) or by `keep_seconds` here, never by a pull request."""

    allowed: bool = setting(True, "whether a repository's trusted file may ask (debug:) for a failed job's VM "
                                  "to be kept", "bool")
    max_keep_seconds: int = setting(900, "the longest a failed job's VM is kept, whatever a repository asks; "
                                         "kept, it holds its job's worker (capacity and the repository's share)",
                                    "int", minimum=0, maximum=DAY)
    keep_seconds: int = setting(0, "keep every failed or timed-out job's VM this long (0: only where a "
                                   "repository's trusted file asks), at most max_keep_seconds", "int",
                                minimum=0, maximum=DAY)
    cut_network: bool = setting(True, "a kept VM's network is cut to nothing (deny-all) while it is kept",
                                "bool")


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
    debug: DebugKeep = setting(None, "keeping a failed job's VM for the operator to attach to (docs/debugging.md)",
                               "section", section=DebugKeep)
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
    recipes: Path | None = setting(None, "the operator's own template recipes, NAME.yml each: the built-in "
                                         "recipe schema, or image: REF for an OCI image (docs/images.md)", "path")
    images: Images = setting(None, "how image templates are fetched (docs/images.md)", "section", section=Images)
    resources: ResourceSettings = setting(None, "job VM size", "section", section=ResourceSettings)
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
    retention: RetentionSettings = setting(None, "how long job records are kept", "section", section=RetentionSettings)
    prewarm: Prewarm = setting(None, "VMs restored ahead of jobs the webhook announces", "section", section=Prewarm)
    bases: Bases = setting(None, "repositories' warm bases: their disk budget and setup timeout", "section",
                           section=Bases)
    network: Network = setting(None, "per-VM networking", "section", section=Network)
    secrets: Path | None = setting(None, "the operator's secret bindings (docs/secrets.md): which repositories' jobs "
                                         "get a placeholder the host swaps for a value from a root-only file, and "
                                         "where it may be sent", "path")
    debug: DebugKeep = setting(None, "keeping a failed job's VM for the operator to attach to (docs/debugging.md)",
                               "section", section=DebugKeep)
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
