"""JobSpec: what a client asks the service to run, validated before anything is spent on it.

Clients include the action running for fork pull requests, so every field is bounded and checked here
(into a Submission, which admission completes into the job's one AdmittedSpec, every field decided) and
the rest of the service can trust its shape. The type, its limits and patterns are the
job API's contract (runner.jobapi.contract); this module holds the checks and the service's defaults.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from runner.errors import JobError
from runner.jobapi.contract import (
    ENV_NAME,
    KEEP_VALUES,
    MAX_ARTIFACT_GLOBS,
    MAX_COMMAND_BYTES,
    MAX_ENV,
    MAX_ENV_VALUE_BYTES,
    MAX_PATH_BYTES,
    MAX_POLICY_BYTES,
    MAX_RUN_ID,
    MAX_SHORT_TEXT,
    REPOSITORY,
    SHA,
    SPEC_FIELDS,
    GitHubJob,
    ServiceContainer,
    WorkflowSecret,
    parse_services,
    parse_workflow_secrets,
)
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.job import AdmittedSpec
from runner.vm.templates import NAME as TEMPLATE_NAME

_SHOWN = 80  # how much of a refused value an error message repeats: errors never echo unbounded input
# Never forwarded whatever the allowlist says: these name credentials, and the guest is hostile.
ENV_DENYLIST = ("*TOKEN*", "*SECRET*", "*PASSWORD*", "*CREDENTIAL*", "*_KEY", "ACTIONS_*")


class SpecError(JobError):
    """An invalid JobSpec; the message names the field."""


def _show(value: object) -> str:
    """A refused value for an error message, cut short: the client may have sent megabytes."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def checked_text(value: object, where: str, limit: int) -> str:
    """A string that is valid UTF-8 (JSON may carry lone surrogates such as "\\ud800", which no file,
    database or guest can take), holds no NUL (it would cut a path or a command short) and fits `limit` bytes."""
    if not isinstance(value, str):
        raise SpecError(f"{where}: expected a string, got {type(value).__name__}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as exc:
        raise SpecError(f"{where}: not valid Unicode text (a lone surrogate at character {exc.start})") from None
    if size > limit:
        raise SpecError(f"{where}: longer than {limit} bytes")
    if "\x00" in value:
        raise SpecError(f"{where}: contains a NUL byte")
    return value


def _text(data: Mapping[str, object], key: str, default: str | None, limit: int = MAX_SHORT_TEXT) -> str:
    value = data.get(key, default)
    if value is None:
        raise SpecError(f"{key}: required")
    return checked_text(value, key, limit)


def _int(data: Mapping[str, object], key: str, minimum: int, maximum: int) -> int | None:
    """An optional integer within [minimum, maximum]: every integer from a client has both bounds."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{key}: expected an integer, got {_show(value)}")
    if not minimum <= value <= maximum:
        shown = value if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
        raise SpecError(f"{key}: must be between {minimum} and {maximum}, got {shown}")
    return value


def relative_path(value: str, where: str, allow_glob: bool = False) -> str:
    """A guest path relative to the checkout; refuses absolute paths and `..` so it stays in /workspace."""
    checked_text(value, where, MAX_PATH_BYTES)
    if not value or value.startswith("/") or "\\" in value:
        raise SpecError(f"{where}: expected a relative path inside the checkout, got {_show(value)}")
    parts = value.split("/")
    if ".." in parts:
        raise SpecError(f"{where}: '..' is not allowed, got {_show(value)}")
    if not allow_glob and any(c in value for c in "*?["):
        raise SpecError(f"{where}: wildcards are not allowed here, got {_show(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise SpecError(f"{where}: control characters in {_show(value)}")
    return value


def env_allowed(name: str, allowlist: tuple[str, ...]) -> bool:
    if any(fnmatch.fnmatchcase(name.upper(), pattern) for pattern in ENV_DENYLIST):
        return False
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in allowlist)


def _env(data: Mapping[str, object], allowlist: tuple[str, ...]) -> dict[str, str]:
    env = data.get("env")
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise SpecError("env: expected a mapping of NAME: value")
    if len(env) > MAX_ENV:
        raise SpecError(f"env: more than {MAX_ENV} variables")
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            raise SpecError(f"env: {_show(name)} is not a valid variable name")
        checked_text(value, f"env.{name}", MAX_ENV_VALUE_BYTES)
        if not env_allowed(name, allowlist):
            raise SpecError(
                f"env.{name}: not forwarded to the guest; the service allows {', '.join(allowlist)} "
                f"and never names like {', '.join(ENV_DENYLIST)}"
            )
    return dict(env)


def _artifacts(data: Mapping[str, object]) -> tuple[str, ...]:
    globs = data.get("artifacts")
    if globs is None:
        return ()
    if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
        raise SpecError("artifacts: expected a list of path globs")
    if len(globs) > MAX_ARTIFACT_GLOBS:
        raise SpecError(f"artifacts: more than {MAX_ARTIFACT_GLOBS} globs")
    return tuple(relative_path(g, f"artifacts[{i}]", allow_glob=True) for i, g in enumerate(globs))


@dataclass(frozen=True)
class Submission:
    """A submitted spec with every field checked and the service's defaults filled in, before the service
    has decided the two things only it decides: the runner the job belongs to and the repository it runs
    as; and before admission has checked the repository may use the size class it asks for. Admission
    (runner/service/jobs/admission.py) decides them from what the submit claims here and builds the job's
    one AdmittedSpec with `spec()`; nothing rewrites it after that. Which template its VM restores from
    (a size class selects the template's variant) is `choose_template`'s (runner/service/jobs/templatechoice.py)."""

    repository: str  # as the client named it
    runner_name: str  # likewise: a fleet runner's submit is bound to its own name instead
    job_name: str
    run_id: int | None
    run_attempt: int | None
    size: str | None
    policy: str | None  # the job's own policy text
    template: str  # checked against the service's own templates and the repository's by `check_template`
    offered: tuple[str, ...]  # the service's: the config's templates:, offered to every repository
    # AdmittedSpec with every other field as checked, waiting for the service's two
    complete: Callable[..., AdmittedSpec] = field(repr=False, compare=False)
    # The workflow's secret bindings, values included: admission decides whether they are honoured and
    # hands them to the job's run, never to its spec (which is kept, shown and recorded).
    secrets: tuple[WorkflowSecret, ...] = field(default=(), repr=False, compare=False)

    @property
    def github(self) -> GitHubJob | None:
        """The GitHub job the client says this is a step of (None: a local job)."""
        return GitHubJob.named(self.repository, self.run_id, self.run_attempt, self.job_name, self.runner_name)

    def claim(self) -> str:
        """The job this submit says it is, for a refusal's message."""
        return f"{self.repository} run {self.run_id}/{self.run_attempt or 1} job {self.job_name}"

    def check_size(self, repository: str, allowed_sizes: tuple[str, ...]) -> None:
        """Refuse a size class the repository's store file does not allow (`allowed_sizes`): a pull request's
        spec cannot widen that."""
        size = self.size
        if size is not None and size not in allowed_sizes:
            raise SpecError(f"size: {repository} may not use the size {size!r} (its store file allows "
                            f"{', '.join(allowed_sizes) or 'no sizes'}): the operator lists a repository's sizes in "
                            f"its store file (<owner>/<repo>.yml, sizes: [{size}]), or leave size out")

    def check_template(self, repository: str, own_templates: tuple[str, ...]) -> None:
        """Refuse a template neither the service offers every repository nor the repository's store file offers
        it (`own_templates`, its `templates:`): a pull request's spec cannot widen either."""
        if self.template in self.offered or self.template in own_templates:
            return
        own = f"offers {', '.join(own_templates)}" if own_templates else "offers none more"
        raise SpecError(f"template: {_show(self.template)} is not offered here to {repository}: the service offers "
                        f"{', '.join(self.offered)} to every repository, and {repository}'s store file {own}; the "
                        f"operator offers a template to one repository in its store file (<owner>/<repo>.yml, "
                        f"templates: [{self.template}]) or to all in the service config's templates:")

    def spec(self, repository: str, runner_name: str) -> AdmittedSpec:
        """The job's spec: as submitted, with the repository and runner the service decided."""
        return self.complete(repository=repository, runner_name=runner_name)


def parse_submission(data: object, config: ServiceConfig) -> Submission:
    if not isinstance(data, dict):
        raise SpecError("the body must be a JSON object (a JobSpec)")
    unknown = [key for key in data if key not in SPEC_FIELDS]
    if unknown:
        key = unknown[0]
        name = key if isinstance(key, str) and key.isprintable() and len(key) <= _SHOWN else _show(key)
        raise SpecError(f"{name}: unknown field")
    repository = _text(data, "repository", None)
    if not REPOSITORY.fullmatch(repository):
        raise SpecError(f"repository: expected owner/name, got {_show(repository)}")
    sha = _text(data, "sha", None)
    if not SHA.fullmatch(sha):
        raise SpecError(f"sha: expected a lowercase hex commit id, got {_show(sha)}")
    command = _text(data, "command", None, MAX_COMMAND_BYTES)
    if not command.strip():
        raise SpecError("command: must not be empty")
    template = _text(data, "template", config.default_template)
    if not TEMPLATE_NAME.fullmatch(template):
        raise SpecError(f"template: {_show(template)} is not a template name; choose one of {', '.join(config.templates)}")
    size = data.get("size")
    if size is not None:
        size = _text(data, "size", None)
        if size not in (config.sizes or {}):
            offered = ", ".join(config.sizes or {}) or "none (the service config has no sizes:)"
            raise SpecError(f"size: {_show(size)} is not offered here; the sizes offered: {offered}")
    policy = data.get("policy")
    if policy is not None:
        policy = _text(data, "policy", None, MAX_POLICY_BYTES)
    timeout = _int(data, "timeout_seconds", 1, config.max_timeout_seconds)
    job_name = _text(data, "job_name", "")
    runner_name = _text(data, "runner_name", "")
    ref, event = _text(data, "ref", ""), _text(data, "event", "")
    run_id, run_attempt = _int(data, "run_id", 0, MAX_RUN_ID), _int(data, "run_attempt", 1, MAX_RUN_ID)
    complete = functools.partial(
        AdmittedSpec,
        sha=sha,
        command=command,
        job_name=job_name,
        ref=ref,
        event=event,
        run_id=run_id,
        run_attempt=run_attempt,
        working_directory=relative_path(_text(data, "working_directory", "."), "working_directory"),
        env=_env(data, config.env_allowlist),
        artifacts=_artifacts(data),
        timeout_seconds=timeout or config.default_timeout_seconds,
        template=template,
        size=size,
        policy=policy,
        services=_services(data),
        keep=_keep(data),
        fork=_fork(data),
    )
    return Submission(repository, runner_name, job_name, run_id, run_attempt, size, policy, template, config.templates,
                      complete, _secrets(data))


def _secrets(data: Mapping[str, object]) -> tuple[WorkflowSecret, ...]:
    if data.get("secrets") is None:
        return ()
    try:
        return parse_workflow_secrets(data["secrets"])
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def _services(data: Mapping[str, object]) -> tuple[ServiceContainer, ...]:
    if data.get("services") is None:
        return ()
    try:
        return parse_services(data["services"])
    except ValueError as exc:
        raise SpecError(str(exc)) from None


def _fork(data: Mapping[str, object]) -> bool:
    value = data.get("fork", False)
    if not isinstance(value, bool):
        raise SpecError(f"fork: expected true or false, got {_show(value)}")
    return value


def _keep(data: Mapping[str, object]) -> str:
    """The `keep` field: "none" (the default) or "job" (runner/service/jobs/sessions.py)."""
    value = data.get("keep", "none")
    if value not in KEEP_VALUES:
        raise SpecError(f"keep: expected one of {', '.join(KEEP_VALUES)}, got {repr(value)[:40]}")
    return str(value)
