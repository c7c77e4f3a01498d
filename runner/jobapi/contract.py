"""The job API's wire contract (docs/job-api.md): the one source the action, `microvm-check run` and the
service import for what travels between them.

Here: the default socket, every limit a JobSpec is held to, the name and commit patterns, the job
states and the moves between them, and the typed forms of what is sent (JobSpec) and answered
(JobSummary, JobRecord, Health, QueueFullAnswer, LogEntry), each with `to_wire()` and, for answers, `from_wire()`.
It imports nothing of the project, so the action can load it without the service, the VM layer or
the network code.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from microvm_check.contract import DEFAULT_SOCKET as DEFAULT_SOCKET  # declared once, where the SDK reads it too
from microvm_check.entries import Artifact, AuditRecord
from runner.errors import ClientError

# -- credentials (docs/job-api.md, "Who may do what"; the rules are runner/service/jobs/auth.py) -------------

# A fleet runner's own credential: the service writes it into the runner's `.env` (0600, the runner
# user's), so the runner hands it to every step; the action and the job hooks send it in this header.
RUNNER_TOKEN_HEADER = "X-Microvm-Check-Runner-Token"
RUNNER_TOKEN_VARIABLE = "MICROVM_CHECK_RUNNER_TOKEN"
# One job's own credential, answered at submit: reading, streaming, cancelling and uploading need it.
JOB_TOKEN_HEADER = "X-Microvm-Check-Job-Token"
# A `keep: job` session's own credential (runner/service/jobs/sessions.py), answered to the step that opened
# it; the job's later steps send it back in this header to attach to the kept VM.
SESSION_TOKEN_HEADER = "X-Microvm-Check-Session-Token"
MAX_TOKEN = 128  # characters of a runner, job or session token

# -- limits -------------------------------------------------------------------------------------------

MAX_JSON_BODY = 1024 * 1024  # a JSON request body
MAX_COMMAND_BYTES = 64 * 1024
MAX_POLICY_BYTES = 64 * 1024  # a job's own policy text (it can only narrow the operator's)
MAX_SHORT_TEXT = 256  # names and refs: repository, job_name, runner_name, ref, event, template
MAX_ENV = 128
MAX_ENV_VALUE_BYTES = 32 * 1024
MAX_ARTIFACT_GLOBS = 64
MAX_PATH_BYTES = 4096  # Linux's PATH_MAX: no guest path is longer
MAX_RUN_ID = 2**63 - 1  # run ids and attempts are stored in SQLite, whose integers are signed 64-bit
LIST_DEFAULT, LIST_MAX = 50, 1000  # GET /v1/jobs?limit=N
MAX_LOG_SEQ = 2**62  # GET /v1/jobs/{id}/logs?after=SEQ

GUEST_WORKSPACE = "/workspace"  # where the checkout is unpacked in the guest
# JobSpec.keep: "job" keeps the VM for the GitHub job's next step (runner/service/jobs/sessions.py).
KEEP_VALUES = ("none", "job")

# -- patterns (use with fullmatch: `$` also matches before a trailing newline) ------------------------

# Neither part may be "." or "..": the name ends up in paths (policy files, API paths).
REPOSITORY = re.compile(r"(?!\.{1,2}/)[A-Za-z0-9_.-]{1,100}/(?!\.{1,2}\Z)[A-Za-z0-9_.-]{1,100}")
SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a SHA-1 or SHA-256 commit id, lowercase
JOB_ID = re.compile(r"j[0-9a-f]{16}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def canonical_repository(name: str) -> str:
    """The one form of a repository name that every comparison and key uses: GitHub's owner and
    repository names are case-insensitive (`Org/Repo` and `org/repo` are one repository), so two
    spellings of one repository must never be two tenants, nor one slip past a check of the other."""
    return name.lower()


class WireError(ClientError):
    """An answer that does not have the contract's shape; the message names the field."""


# -- job states ---------------------------------------------------------------------------------------


class JobState(enum.StrEnum):
    AWAITING_CHECKOUT = "awaiting_checkout"
    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def final(self) -> bool:
        return self in FINAL_STATES

    def can_become(self, new: JobState) -> bool:
        return new == self or new in _MOVES[self]


_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.AWAITING_CHECKOUT: frozenset({JobState.QUEUED, JobState.CANCELLED, JobState.FAILED}),
    # Back to awaiting_checkout only when the queued record could not be saved: the job never left.
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED, JobState.AWAITING_CHECKOUT}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.FINISHED, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.TIMED_OUT: frozenset(),
}
ACTIVE_STATES = (JobState.AWAITING_CHECKOUT, JobState.QUEUED, JobState.STARTING, JobState.RUNNING)
FINAL_STATES = (JobState.FINISHED, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT)


class StateTransitionError(RuntimeError):
    """A move between job states the contract does not allow: a bug in the service, never the client's doing."""


# -- what a client sends ------------------------------------------------------------------------------


MAX_SERVICES = 8
MAX_READY_TIMEOUT_S = 600
SERVICE_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
# A Docker image reference: [registry[:port]/]path[:tag][@digest], lowercase path components.
IMAGE_REF = re.compile(r"[a-z0-9][a-z0-9._-]*(?::[0-9]{1,5})?(?:/[a-z0-9][a-z0-9._-]*){0,8}"
                       r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?")
PORT_MAPPING = re.compile(r"(?:([0-9]{1,5}):)?([0-9]{1,5})")
SERVICE_KEYS = frozenset({"name", "image", "build", "env", "ports", "ready", "ready_timeout_seconds"})

# -- secret bindings from the workflow (the action's `secrets:` input; docs/secrets.md) -----------------

MAX_WORKFLOW_SECRETS = 16
MAX_SECRET_VALUE = 4096  # characters of a value (the service's own rules: runner.net.secretswap.value_problem)
SECRET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
SECRET_KEYS = frozenset({"name", "env", "host", "ports", "methods", "paths", "scheme", "user", "header", "value"})


@dataclass(frozen=True)
class WorkflowSecret:
    """A secret binding the workflow asks for (the action's `secrets:` input): where the service may send
    `value`, which the guest never gets (its variable `env` holds a placeholder). The service honours it
    only for a trusted workflow (docs/secrets.md) and keeps the value in memory only: it is on the wire
    of POST /v1/jobs and nowhere else, never in a repr, the job's spec as the service keeps it, or its record."""

    name: str
    env: str
    host: str
    paths: tuple[str, ...]
    ports: tuple[int, ...] = (443,)
    methods: tuple[str, ...] = ("GET",)
    scheme: str = "bearer"
    user: str | None = None
    header: str = "authorization"
    value: str = field(default="", repr=False, compare=False)

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire.update(ports=list(self.ports), methods=list(self.methods), paths=list(self.paths))
        return {k: v for k, v in wire.items() if v is not None}


def parse_workflow_secrets(value: object) -> tuple[WorkflowSecret, ...]:
    """Secret bindings from their JSON/YAML shape (a list of mappings); ValueError says what is wrong and
    where (`secrets[0].host: ...`), never quoting a value. The action (its input) and the service (the
    spec) use it; the service then checks each binding as the operator's are (runner.net.secretswap)."""
    if not isinstance(value, list) or len(value) > MAX_WORKFLOW_SECRETS:
        raise ValueError(f"secrets: expected a list of at most {MAX_WORKFLOW_SECRETS} bindings, "
                         f"got {type(value).__name__}{f' of {len(value)}' if isinstance(value, list) else ''}")
    found = [_workflow_secret(item, f"secrets[{index}]") for index, item in enumerate(value)]
    for key in ("name", "env"):
        seen = [getattr(secret, key) for secret in found]
        if len(set(seen)) != len(seen):
            raise ValueError(f"secrets: two bindings have the same {key}")
    return tuple(found)


def _workflow_secret(item: object, where: str) -> WorkflowSecret:
    if not isinstance(item, dict):
        raise ValueError(f"{where}: expected a mapping of {', '.join(sorted(SECRET_KEYS))}, got {type(item).__name__}")
    unknown = sorted(str(k)[:40] for k in item if k not in SECRET_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {', '.join(sorted(SECRET_KEYS))}")
    name = item.get("name")
    if not isinstance(name, str) or not SECRET_NAME.fullmatch(name):
        raise ValueError(f"{where}.name: expected 1-64 lower-case letters, digits, '_' or '-', got {str(name)[:40]!r}")
    where = f"secrets.{name}"
    for key in ("env", "host", "paths", "value"):
        if item.get(key) is None:
            raise ValueError(f"{where}: {key} is required")
    texts = {key: item.get(key) for key in ("env", "host", "scheme", "user", "header")}
    for key, text in texts.items():
        if text is not None and (not isinstance(text, str) or not text or len(text) > MAX_SHORT_TEXT):
            raise ValueError(f"{where}.{key}: expected a string of up to {MAX_SHORT_TEXT} characters")
    if not ENV_NAME.fullmatch(str(texts["env"])):
        raise ValueError(f"{where}.env: {str(texts['env'])[:40]!r} is not a variable name")
    secret = item["value"]
    if not isinstance(secret, str) or not secret or len(secret) > MAX_SECRET_VALUE:
        raise ValueError(f"{where}.value: expected a string of 1 to {MAX_SECRET_VALUE} characters (not shown); "
                         "is the secret that feeds it set for this workflow?")
    lists = {key: item.get(key) for key in ("paths", "methods")}
    for key, items in lists.items():
        if items is not None and (not isinstance(items, list) or not items or len(items) > 32 or not all(
                isinstance(text, str) and 0 < len(text) <= MAX_SHORT_TEXT for text in items)):
            raise ValueError(f"{where}.{key}: expected a list of up to 32 strings")
    ports = item.get("ports", [443])
    if not isinstance(ports, list) or not ports or len(ports) > 16 or not all(
            type(port) is int and 1 <= port <= 65535 for port in ports):
        raise ValueError(f"{where}.ports: expected a list of port numbers (1-65535), like [443]")
    return WorkflowSecret(name, str(texts["env"]), str(texts["host"]), tuple(lists["paths"] or ()), tuple(ports),
                          tuple(lists["methods"] or ("GET",)), str(texts["scheme"] or "bearer"),
                          None if texts["user"] is None else str(texts["user"]),
                          str(texts["header"] or "authorization"), secret)


@dataclass(frozen=True)
class ServiceContainer:
    """A container started in the job's VM before its command and removed after (the action's `services:`):
    from `image` (pulled through the job's egress policy unless the VM has it) or built from `build`, a
    directory of the checkout. `ports` publish on the VM's localhost ("5432" or "HOST:CONTAINER");
    `ready`, a shell command run in the VM, must succeed within `ready_timeout_seconds` before the job's
    command starts. Everything here is the workflow's (a fork's) text, run only inside its VM."""

    name: str
    image: str | None = None
    build: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    ports: tuple[str, ...] = ()
    ready: str | None = None
    ready_timeout_seconds: int = 60

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire["ports"] = list(self.ports)
        return {k: v for k, v in wire.items() if v is not None}


def parse_services(value: object) -> tuple[ServiceContainer, ...]:
    """Service containers from their JSON/YAML shape (a list of mappings); ValueError says what is wrong
    and where (`services[1].image: ...`). Both the action (its input) and the service (the spec) use it."""
    if not isinstance(value, list) or len(value) > MAX_SERVICES:
        raise ValueError(f"services: expected a list of at most {MAX_SERVICES} services, got {type(value).__name__}")
    found: list[ServiceContainer] = []
    for index, item in enumerate(value):
        where = f"services[{index}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping with name and image (or build), got {type(item).__name__}")
        unknown = sorted(str(k)[:40] for k in item if k not in SERVICE_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {', '.join(sorted(SERVICE_KEYS))}")
        found.append(_service(item, where))
    names = [s.name for s in found]
    if len(set(names)) != len(names):
        raise ValueError("services: two services have the same name")
    return tuple(found)


def _service(item: dict[str, Any], where: str) -> ServiceContainer:
    name = item.get("name")
    if not isinstance(name, str) or not SERVICE_NAME.fullmatch(name):
        raise ValueError(f"{where}.name: expected a lowercase name (letters, digits, '-'; up to 32), "
                         f"got {str(name)[:40]!r}")
    image, build = item.get("image"), item.get("build")
    if (image is None) == (build is None):
        raise ValueError(f"{where}: give exactly one of image (a Docker image) and build (a directory of the checkout)")
    if image is not None and (not isinstance(image, str) or len(image) > MAX_SHORT_TEXT
                              or not IMAGE_REF.fullmatch(image)):
        raise ValueError(f"{where}.image: not a Docker image reference: {str(image)[:80]!r}")
    if build is not None and (not isinstance(build, str) or not build or len(build) > MAX_PATH_BYTES
                              or build.startswith("/") or ".." in build.split("/") or "\0" in build):
        raise ValueError(f"{where}.build: expected a relative directory inside the checkout, got {str(build)[:80]!r}")
    env = item.get("env") or {}
    if not isinstance(env, dict) or len(env) > MAX_ENV or not all(
            isinstance(k, str) and ENV_NAME.fullmatch(k) and isinstance(v, (str, int, float)) and len(str(v)) <= 4096
            for k, v in env.items()):
        raise ValueError(f"{where}.env: expected a mapping of NAME: value (at most {MAX_ENV}, values up to 4 KiB)")
    ports = item.get("ports") or []
    if not isinstance(ports, list) or len(ports) > 16 or not all(_port(p) for p in ports):
        raise ValueError(f"{where}.ports: expected a list of ports, each PORT or HOST:CONTAINER (1-65535)")
    ready = item.get("ready")
    if ready is not None and (not isinstance(ready, str) or not ready.strip() or len(ready) > 4096 or "\0" in ready):
        raise ValueError(f"{where}.ready: expected a shell command (up to 4 KiB) that succeeds once the service "
                         "is ready")
    timeout = item.get("ready_timeout_seconds", 60)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= MAX_READY_TIMEOUT_S:
        raise ValueError(f"{where}.ready_timeout_seconds: expected whole seconds from 1 to {MAX_READY_TIMEOUT_S}")
    return ServiceContainer(name, image, build, {k: str(v) for k, v in env.items()}, tuple(str(p) for p in ports),
                            ready, timeout)


def _port(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return False
    match = PORT_MAPPING.fullmatch(str(value))
    return match is not None and all(1 <= int(p) <= 65535 for p in match.groups() if p is not None)


@dataclass(frozen=True, eq=False)
class GitHubJob:
    """One GitHub Actions job, as every layer names it: the spec a runner submits (`JobSpec.github`),
    the report its job-started hook sends (`JobStarted.job`), a kept VM's session, a pre-warmed VM's
    run and a webhook's job. `job` is the job's key in the workflow (GITHUB_JOB), or a webhook's display
    name; `runner` the self-hosted runner that took it ("" unknown).

    Two are equal when they name the same job in the one normal form (`key`: the repository through
    `canonical_repository`, GitHub's names being case-insensitive); `same_run` and `named_by` are the
    looser matches, written here once.
    """

    repository: str  # as GitHub or the client spelled it (shown, and looked up in the policy store)
    run_id: int
    run_attempt: int = 1
    job: str = ""
    runner: str = ""

    @property
    def run(self) -> tuple[str, int, int]:
        return canonical_repository(self.repository), self.run_id, self.run_attempt

    @property
    def key(self) -> tuple[str, int, int, str, str]:
        return (*self.run, self.job, self.runner)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GitHubJob) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @classmethod
    def named(cls, repository: str, run_id: int | None, run_attempt: int | None, job: str,
              runner: str) -> GitHubJob | None:
        """The GitHub job a spec's fields name; None when they name no run (a local job)."""
        return None if run_id is None else cls(repository, run_id, run_attempt or 1, job, runner)

    def same_run(self, other: GitHubJob) -> bool:
        """The same workflow run and attempt (a pre-warmed VM's claim; a runner's binding against a webhook)."""
        return self.run == other.run

    def same_job(self, other: GitHubJob) -> bool:
        """The same run and job key, whichever runner (a runner's submit against the job its hook reported)."""
        return self.same_run(other) and self.job == other.job

    def named_by(self, other: GitHubJob) -> bool:
        """Whether a webhook's job (`other`) is this one. The webhook names a job by its display name
        (`build (3.11)`), the action by its key in the workflow (`build`), so names decide only when a
        runner is unknown: a self-hosted runner runs one job at a time, so the run plus the runner's
        name identify the job exactly."""
        if not self.same_run(other):
            return False
        if self.runner and other.runner:
            return self.runner == other.runner
        return self.job == other.job

    def describe(self) -> str:
        return f"{self.repository} run {self.run_id}/{self.run_attempt} job {self.job}"


@dataclass(frozen=True)
class JobSpec:
    """What to run, as a client sends it: `template` and `timeout_seconds` left None take the service's
    defaults. The service validates a received spec (runner.service.jobs.spec) and builds from it, once at
    admission, its own AdmittedSpec (runner.service.jobs.job), every field decided: those defaults, and what
    only it decides, the repository the job runs as and its runner."""

    repository: str
    sha: str
    command: str
    job_name: str = ""
    runner_name: str = ""  # the self-hosted runner that took the job: with the run, identifies the job
    ref: str = ""
    event: str = ""
    run_id: int | None = None
    run_attempt: int | None = None
    working_directory: str = "."
    env: dict[str, str] = field(default_factory=dict)
    artifacts: tuple[str, ...] = ()
    timeout_seconds: int | None = None
    template: str | None = None
    # A size class of the service's config (`sizes:`): the VM restores from `<template>.<size>`, baked at
    # its vCPUs, memory and disk; the repository's store file must allow it. None: the template's own size.
    size: str | None = None
    policy: str | None = None
    # "job": the VM stays for the same GitHub job's next step, which attaches to it instead of
    # getting a new one (and sends no checkout); "none": a step that finds a kept VM runs in it and ends it.
    keep: str = "none"
    # Containers started in the VM before the command and removed after it (the action's `services:`).
    services: tuple[ServiceContainer, ...] = ()
    # The pull request comes from a fork (the event's head repository is another one): the action's
    # reading of the runner's event file, used for the `checks: forks` setting only, never to allow anything.
    fork: bool = False
    # Secret bindings of the workflow (the action's `secrets:` input), values included: sent by a client,
    # never kept in the service's spec (admission takes them out: runner/service/jobs/admission.py).
    secrets: tuple[WorkflowSecret, ...] = ()

    @property
    def github(self) -> GitHubJob | None:
        """The GitHub job this spec is a step of; None when it names no run (a local job)."""
        return GitHubJob.named(self.repository, self.run_id, self.run_attempt, self.job_name, self.runner_name)

    @property
    def workdir(self) -> str:
        """The guest directory the command runs in."""
        rel = self.working_directory.strip("/")
        return GUEST_WORKSPACE if rel in ("", ".") else f"{GUEST_WORKSPACE}/{rel}"

    def to_wire(self) -> dict[str, Any]:
        """The JSON object of POST /v1/jobs; unset optional fields are left out (the service's defaults)."""
        wire = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        wire["env"] = dict(self.env)
        wire["artifacts"] = list(self.artifacts)
        if self.keep == "none":
            del wire["keep"]  # the default: a service that predates `keep` still takes the spec
        if not self.fork:
            del wire["fork"]  # likewise
        if self.services:
            wire["services"] = [service.to_wire() for service in self.services]
        else:
            del wire["services"]  # likewise
        if self.secrets:
            wire["secrets"] = [secret.to_wire() for secret in self.secrets]
        else:
            del wire["secrets"]  # likewise
        return wire


SPEC_FIELDS = frozenset(f.name for f in fields(JobSpec))

# -- what the service answers -------------------------------------------------------------------------


def _field(data: Mapping[str, Any], key: str, kinds: tuple[type, ...], optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    # bool is an int to Python, never to this contract
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise WireError(f"{key}: expected {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def _state(data: Mapping[str, Any]) -> JobState:
    state = data.get("state")
    if isinstance(state, str):
        try:
            return JobState(state)
        except ValueError:
            pass
    raise WireError(f"state: not a job state: {str(state)[:40]!r}")


def _object(data: object, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise WireError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class JobSummary:
    """The answer to a submit and to a checkout upload; a submit's also carries the job's own token."""

    id: str
    state: JobState
    token: str | None = field(default=None, repr=False, compare=False)  # a secret, not part of what the job is
    # A submit that opened a `keep: job` session: its token, which the job's later steps send back.
    session_token: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_wire(cls, data: object) -> JobSummary:
        data = _object(data, "job")
        return cls(id=_field(data, "id", (str,)), state=_state(data), token=_field(data, "token", (str,), True),
                   session_token=_field(data, "session_token", (str,), True))

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"id": self.id, "state": self.state.value}
        if self.token is not None:
            wire["token"] = self.token
        if self.session_token is not None:
            wire["session_token"] = self.session_token
        return wire


@dataclass(frozen=True)
class JobStarted:
    """A fleet runner's job-started hook to the service: the job it got (what GitHub told the runner),
    and what the fork guard needs of the event (`runner.github.guard.JobContext`, as wire). On the
    wire the job's fields are flat: repository, run_id, run_attempt, job."""

    job: GitHubJob  # its runner is the one whose token sent the report (set by the service, never sent)
    workflow_ref: str
    event: str
    guard: dict[str, Any] | None = None  # None when the hook could not read the event: the guard refuses

    @classmethod
    def from_wire(cls, data: object) -> JobStarted:
        data = _object(data, "job")
        job = GitHubJob(repository=_field(data, "repository", (str,)), run_id=_field(data, "run_id", (int,)),
                        run_attempt=_field(data, "run_attempt", (int,)), job=_field(data, "job", (str,)))
        return cls(job, workflow_ref=_field(data, "workflow_ref", (str,)), event=_field(data, "event", (str,)),
                   guard=_field(data, "guard", (dict,), True))

    def to_wire(self) -> dict[str, Any]:
        job = self.job
        return {"repository": job.repository, "run_id": job.run_id, "run_attempt": job.run_attempt, "job": job.job,
                "workflow_ref": self.workflow_ref, "event": self.event, "guard": self.guard}

    def describe(self) -> str:
        return self.job.describe()


@dataclass(frozen=True)
class Verdict:
    """The service's answer to a job-started hook: whether the job may run, and why not."""

    allowed: bool
    reasons: tuple[str, ...] = ()

    @classmethod
    def from_wire(cls, data: object) -> Verdict:
        data = _object(data, "verdict")
        reasons = _field(data, "reasons", (list,))
        if not all(isinstance(reason, str) for reason in reasons):
            raise WireError("reasons: expected a list of strings")
        return cls(allowed=_field(data, "allowed", (bool,)), reasons=tuple(reasons))

    def to_wire(self) -> dict[str, Any]:
        return {"allowed": self.allowed, "reasons": list(self.reasons)}


@dataclass
class Timings:
    queued_at: float | None = None
    vm_ready_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    vm_ready_ms: float | None = None

    @classmethod
    def from_wire(cls, data: object) -> Timings:
        data = _object(data if data is not None else {}, "timings")
        return cls(**{f.name: _field(data, f.name, (int, float), optional=True) for f in fields(cls)})


@dataclass(frozen=True)
class TemplateRef:
    """A template as one build of it: its name and the digest of that build (`template list` shows both)."""

    name: str
    digest: str

    @classmethod
    def from_wire(cls, data: object, what: str) -> TemplateRef:
        data = _object(data, what)
        return cls(name=_field(data, "name", (str,)), digest=_field(data, "digest", (str,)))


@dataclass(frozen=True)
class ImageUsed:
    """The OCI image a template was built from: the reference as its build pinned it (`REF@sha256:...` from
    a registry; an `oci:`/`oci-archive:` source as named) and the digest of the manifest it unpacked."""

    ref: str
    digest: str

    @classmethod
    def from_wire(cls, data: object) -> ImageUsed:
        data = _object(data, "image")
        return cls(ref=_field(data, "ref", (str,)), digest=_field(data, "digest", (str,)))


@dataclass(frozen=True)
class RestoredFrom:
    """What a job's VM restored from, as `choose_template` decided and the build's manifest says, read when
    the VM started (the service's own knowledge, never the guest's): the template (a recipe's or an image's;
    a size class is a template of its own, `base.large`), the base when the VM came from a template derived
    from it (a job's: the repository's warm base; a sandbox's: the snapshot it was forked or resumed from),
    the image the template was built from, and the accelerator. The record, `jobs show`, the page, the check
    run and the signed record (`warmBase`) show this one value."""

    template: TemplateRef | None  # None: the build went away before it could be read
    base: TemplateRef | None = None
    image: ImageUsed | None = None  # None: a recipe's template
    accelerator: str | None = None

    @classmethod
    def of_manifest(cls, manifest: object, accelerator: object) -> RestoredFrom:
        """From the manifest of the build the VM restored from (a derived one names its chain's origin, and
        keeps its `image`: runner.vm.templates.TemplateStore.write_derived) and the engine's accelerator;
        any of them unreadable is None."""
        accel = accelerator if isinstance(accelerator, str) else None
        if not isinstance(manifest, Mapping):
            return cls(None, accelerator=accel)
        own = _template_ref(manifest)
        root = _template_ref(manifest.get("origin")) or _template_ref(manifest.get("parent"))  # older: parent only
        entry = manifest.get("image")  # vmimages.imageroot.record's
        image = None
        if isinstance(entry, Mapping) and isinstance(entry.get("pinned"), str) and isinstance(entry.get("manifest_digest"), str):
            image = ImageUsed(entry["pinned"], entry["manifest_digest"])
        return cls(root or own, own if root else None, image, accel)

    def describe(self) -> str:
        """One line for people: `jobs show`, the page, the check run."""
        if self.template is None:
            return "a template build that was gone before it could be read"
        text = f"{self.template.name} ({self.template.digest})"
        if self.base is not None:
            text = f"the base {self.base.name} ({self.base.digest}) of {text}"
        if self.image is not None:
            text += f", image {self.image.ref} ({self.image.digest})"
        return text + (f", {self.accelerator}" if self.accelerator else "")

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: object) -> RestoredFrom | None:
        """None when absent (records from before it was kept)."""
        if data is None:
            return None
        data = _object(data, "restored_from")
        return cls(
            template=None if data.get("template") is None else TemplateRef.from_wire(data["template"], "template"),
            base=None if data.get("base") is None else TemplateRef.from_wire(data["base"], "base"),
            image=None if data.get("image") is None else ImageUsed.from_wire(data["image"]),
            accelerator=_field(data, "accelerator", (str,), optional=True))


def _template_ref(value: object) -> TemplateRef | None:
    if isinstance(value, Mapping) and isinstance(value.get("name"), str) and isinstance(value.get("digest"), str):
        return TemplateRef(value["name"], value["digest"])
    return None


@dataclass
class JobRecord:
    """A job as the service keeps it and answers it. Its state moves only as JobState allows: setting
    `state` checks the move (the service's threads change it, and a final record must stay final)."""

    id: str
    state: JobState
    repository: str
    sha: str
    run_id: int | None
    run_attempt: int | None
    job_name: str
    created_at: float = field(default_factory=time.time)
    vm_id: str | None = None
    policy_digest: str | None = None
    warm: bool = False
    exit_code: int | None = None
    error: str | None = None
    timings: Timings = field(default_factory=Timings)
    # Derived from guest traffic and guest files: checked where they enter (microvm_check.entries), and
    # every text is escaped where it is shown.
    blocked_egress: list[AuditRecord] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    command: str = ""  # the spec's command, for operators (`jobs`, the page); "" in records from before it was kept
    # The entries of the job's own policy that the repository's allowed nothing of (`policy.compose.narrowed_away`).
    narrowed_egress: list[str] = field(default_factory=list)
    # The job's secret bindings and how often each value went out (docs/secrets.md): name, host, source
    # ("operator" or "workflow") and requests; never a value. [] when it had none, or in older records.
    secrets_used: list[dict[str, Any]] = field(default_factory=list)
    # The terminal sessions attached to its VM (`jobs attach`/`jobs exec`, docs/debugging.md), in the order
    # they attached: session (its number in the transcript), who, argv, attached_at, ended_at and ended (None
    # while attached), bytes_in (typed), bytes_out (the guest's output). [] when none, or in older records.
    terminal_sessions: list[dict[str, Any]] = field(default_factory=list)
    # What its VM restored from (a step in a kept VM: what that VM did); None until a VM started, or in older records.
    restored_from: RestoredFrom | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state":
            new = JobState(value)
            old = self.__dict__.get("state")
            if old is not None and not old.can_become(new):
                raise StateTransitionError(f"job {self.__dict__.get('id')}: {old} cannot become {new}")
            value = new
        object.__setattr__(self, name, value)

    @property
    def final(self) -> bool:
        return self.state.final

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire["state"] = self.state.value
        wire["blocked_egress"] = [entry.to_wire() for entry in self.blocked_egress]
        wire["artifacts"] = [entry.to_wire() for entry in self.artifacts]
        wire["restored_from"] = None if self.restored_from is None else self.restored_from.to_wire()
        return wire

    @classmethod
    def from_wire(cls, data: object) -> JobRecord:
        data = _object(data, "job record")
        return cls(
            id=_field(data, "id", (str,)),
            state=_state(data),
            repository=_field(data, "repository", (str,)),
            sha=_field(data, "sha", (str,)),
            run_id=_field(data, "run_id", (int,), optional=True),
            run_attempt=_field(data, "run_attempt", (int,), optional=True),
            job_name=_field(data, "job_name", (str,)),
            created_at=_field(data, "created_at", (int, float)),
            vm_id=_field(data, "vm_id", (str,), optional=True),
            policy_digest=_field(data, "policy_digest", (str,), optional=True),
            warm=_field(data, "warm", (bool,)),
            exit_code=_field(data, "exit_code", (int,), optional=True),
            error=_field(data, "error", (str,), optional=True),
            timings=Timings.from_wire(data.get("timings")),
            command=_field(data, "command", (str,), optional=True) or "",
            narrowed_egress=_strings(data.get("narrowed_egress"), "narrowed_egress"),
            secrets_used=_secrets_used(data.get("secrets_used")),
            terminal_sessions=_objects(data.get("terminal_sessions"), "terminal_sessions"),
            blocked_egress=_entries(data, "blocked_egress", AuditRecord.from_wire),
            artifacts=_entries(data, "artifacts", Artifact.from_wire),
            restored_from=RestoredFrom.from_wire(data.get("restored_from")),
        )


EXIT_FAILED = 1  # a step whose job failed, or was cancelled, without a usable status of the guest's
EXIT_TIMED_OUT = 124  # a step whose job timed out before the guest gave a status (timeout(1)'s)


def step_exit_code(state: object, exit_code: object) -> int:
    """A job's step exit status, decided one way for the action, `run` and the page: the guest's status
    when it is an integer 0-255 (it is untrusted), else 124 for a timed-out job and 1 for any other;
    a 0 counts only for a finished job (a job that failed around a passing command, say its artifacts
    were refused, is 1). `state` None is a record from before states were answered: finished."""
    if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
        return EXIT_TIMED_OUT if state == JobState.TIMED_OUT else EXIT_FAILED
    if exit_code == 0 and state not in (JobState.FINISHED, None):
        return EXIT_FAILED
    return exit_code


Entry = TypeVar("Entry")


def _entries(data: Mapping[str, Any], key: str, read: Callable[[object], Entry | None]) -> list[Entry]:
    """A record's list of guest-derived entries, each read by `read` (its from_wire): one that is no JSON
    object makes the record none, one that breaks the entry's rules is left out."""
    items = _field(data, key, (list,))
    if not all(isinstance(item, dict) for item in items):
        raise WireError(f"{key}: expected a list of JSON objects")
    return [entry for entry in map(read, items) if entry is not None]


def _strings(value: object, key: str) -> list[str]:
    """An optional list of strings (absent in records from before the field): [] when missing."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise WireError(f"{key}: expected a list of strings")
    return value


def _secrets_used(value: object) -> list[dict[str, Any]]:
    """A record's `secrets_used` (absent in records from before it): [] when missing."""
    return _objects(value, "secrets_used")


def _objects(value: object, key: str) -> list[dict[str, Any]]:
    """An optional list of JSON objects (absent in records from before the field): [] when missing."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise WireError(f"{key}: expected a list of JSON objects")
    return value


@dataclass(frozen=True)
class Health:
    """GET /v1/health: `accel` is None until the service has started its first VM. The counts are the
    whole host's (every repository's jobs): None unless the caller is the operator."""

    ok: bool
    accel: str | None
    running: int | None
    queued: int | None
    warm: int | None

    @classmethod
    def from_wire(cls, data: object) -> Health:
        data = _object(data, "health")
        return cls(ok=_field(data, "ok", (bool,)), accel=_field(data, "accel", (str,), optional=True),
                   running=_field(data, "running", (int,), optional=True),
                   queued=_field(data, "queued", (int,), optional=True),
                   warm=_field(data, "warm", (int,), optional=True))

    def without_counts(self) -> Health:
        return Health(ok=self.ok, accel=self.accel, running=None, queued=None, warm=None)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QueueFullAnswer:
    """The body of a submit's `429` (with `Retry-After`): `queued` is how many jobs were waiting to start
    (submitted, incl. awaiting checkout) when the service refused, so a client can say what it waits behind."""

    error: str
    queued: int

    @classmethod
    def from_wire(cls, data: object) -> QueueFullAnswer:
        data = _object(data, "queue-full answer")
        queued = _field(data, "queued", (int,))
        if queued < 0:
            raise WireError(f"queued: expected a count, got {queued!r}")
        return cls(error=_field(data, "error", (str,)), queued=queued)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LogEntry:
    """One line of GET /v1/jobs/{id}/logs: a piece of the guest's output, or a `system` note."""

    seq: int
    stream: str  # stdout, stderr or system
    ts: float  # when the service received it (unix time)
    data: bytes

    @classmethod
    def from_wire(cls, data: object) -> LogEntry:
        data = _object(data, "log entry")
        try:
            raw = base64.b64decode(_field(data, "data", (str,)), validate=True)
        except binascii.Error as exc:
            raise WireError(f"data: not base64: {exc}") from None
        return cls(seq=_field(data, "seq", (int,)), stream=_field(data, "stream", (str,)),
                   ts=float(_field(data, "ts", (int, float))), data=raw)

    def to_wire(self) -> dict[str, Any]:
        return {"seq": self.seq, "stream": self.stream, "ts": self.ts, "data": base64.b64encode(self.data).decode()}
