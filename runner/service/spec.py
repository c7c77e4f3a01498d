"""JobSpec: what a client asks the service to run, validated before anything is spent on it.

Clients include the action running for fork pull requests, so every field is bounded and checked here
and the rest of the service can trust a JobSpec's shape.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from runner.service.config import ServiceConfig

MAX_COMMAND_BYTES = 64 * 1024
MAX_POLICY_BYTES = 64 * 1024
MAX_ENV = 128
MAX_ENV_VALUE_BYTES = 32 * 1024
MAX_ARTIFACT_GLOBS = 64

_REPOSITORY = re.compile(r"^[A-Za-z0-9_.-]{1,100}/[A-Za-z0-9_.-]{1,100}$")
_SHA = re.compile(r"^([0-9a-f]{40}|[0-9a-f]{64})$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_SHORT_TEXT = 256
# Never forwarded whatever the allowlist says: these name credentials, and the guest is hostile.
ENV_DENYLIST = ("*TOKEN*", "*SECRET*", "*PASSWORD*", "*CREDENTIAL*", "*_KEY", "ACTIONS_*")


class SpecError(ValueError):
    """An invalid JobSpec; the message names the field."""


@dataclass(frozen=True)
class JobSpec:
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
    timeout_seconds: int = 3600
    template: str = "base"
    policy: str | None = None

    @property
    def workdir(self) -> str:
        """The guest directory the command runs in."""
        rel = self.working_directory.strip("/")
        return "/workspace" if rel in ("", ".") else f"/workspace/{rel}"


def _text(data: dict[str, Any], key: str, default: str | None, limit: int = _SHORT_TEXT) -> str:
    value = data.get(key, default)
    if value is None:
        raise SpecError(f"{key}: required")
    if not isinstance(value, str):
        raise SpecError(f"{key}: expected a string, got {type(value).__name__}")
    if len(value.encode()) > limit:
        raise SpecError(f"{key}: longer than {limit} bytes")
    if "\x00" in value:
        raise SpecError(f"{key}: contains a NUL byte")
    return value


def _int(data: dict[str, Any], key: str, minimum: int, maximum: int | None = None) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{key}: expected an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise SpecError(f"{key}: must be between {minimum} and {maximum}, got {value}")
    return value


def relative_path(value: str, where: str, allow_glob: bool = False) -> str:
    """A guest path relative to the checkout; refuses absolute paths and `..` so it stays in /workspace."""
    if not value or value.startswith("/") or "\\" in value:
        raise SpecError(f"{where}: expected a relative path inside the checkout, got {value!r}")
    parts = value.split("/")
    if ".." in parts:
        raise SpecError(f"{where}: '..' is not allowed, got {value!r}")
    if not allow_glob and any(c in value for c in "*?["):
        raise SpecError(f"{where}: wildcards are not allowed here, got {value!r}")
    if any(ord(c) < 32 for c in value):
        raise SpecError(f"{where}: control characters in {value!r}")
    return value


def env_allowed(name: str, allowlist: tuple[str, ...]) -> bool:
    if any(fnmatch.fnmatchcase(name.upper(), pattern) for pattern in ENV_DENYLIST):
        return False
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in allowlist)


def _env(data: dict[str, Any], allowlist: tuple[str, ...]) -> dict[str, str]:
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise SpecError("env: expected a mapping of NAME: value")
    if len(env) > MAX_ENV:
        raise SpecError(f"env: more than {MAX_ENV} variables")
    for name, value in env.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise SpecError(f"env: {name!r} is not a valid variable name")
        if not isinstance(value, str) or "\x00" in value or len(value.encode()) > MAX_ENV_VALUE_BYTES:
            raise SpecError(f"env.{name}: expected a string without NUL of at most {MAX_ENV_VALUE_BYTES} bytes")
        if not env_allowed(name, allowlist):
            raise SpecError(
                f"env.{name}: not forwarded to the guest; the service allows {', '.join(allowlist)} "
                f"and never names like {', '.join(ENV_DENYLIST)}"
            )
    return dict(env)


def _artifacts(data: dict[str, Any]) -> tuple[str, ...]:
    globs = data.get("artifacts") or []
    if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
        raise SpecError("artifacts: expected a list of path globs")
    if len(globs) > MAX_ARTIFACT_GLOBS:
        raise SpecError(f"artifacts: more than {MAX_ARTIFACT_GLOBS} globs")
    return tuple(relative_path(g, f"artifacts[{i}]", allow_glob=True) for i, g in enumerate(globs))


def parse_spec(data: Any, config: ServiceConfig) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError("the body must be a JSON object (a JobSpec)")
    unknown = sorted(set(data) - {f for f in JobSpec.__dataclass_fields__})
    if unknown:
        raise SpecError(f"{unknown[0]}: unknown field")
    repository = _text(data, "repository", None)
    if not _REPOSITORY.match(repository):
        raise SpecError(f"repository: expected owner/name, got {repository!r}")
    sha = _text(data, "sha", None)
    if not _SHA.match(sha):
        raise SpecError(f"sha: expected a lowercase hex commit id, got {sha!r}")
    command = _text(data, "command", None, MAX_COMMAND_BYTES)
    if not command.strip():
        raise SpecError("command: must not be empty")
    template = _text(data, "template", config.default_template)
    if template not in config.templates:
        raise SpecError(f"template: {template!r} is not offered here; choose one of {', '.join(config.templates)}")
    policy = data.get("policy")
    if policy is not None:
        policy = _text(data, "policy", None, MAX_POLICY_BYTES)
    timeout = _int(data, "timeout_seconds", 1, config.max_timeout_seconds)
    return JobSpec(
        repository=repository,
        sha=sha,
        command=command,
        job_name=_text(data, "job_name", ""),
        runner_name=_text(data, "runner_name", ""),
        ref=_text(data, "ref", ""),
        event=_text(data, "event", ""),
        run_id=_int(data, "run_id", 0),
        run_attempt=_int(data, "run_attempt", 1),
        working_directory=relative_path(_text(data, "working_directory", "."), "working_directory"),
        env=_env(data, config.env_allowlist),
        artifacts=_artifacts(data),
        timeout_seconds=timeout or config.default_timeout_seconds,
        template=template,
        policy=policy,
    )
