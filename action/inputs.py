"""The action's inputs and the JobSpec built from them and from the GitHub Actions environment.

action.yml hands every input over as an `INPUT_<NAME>` variable (never by pasting `${{ inputs.* }}`
into the script, which would let input text become shell code). Values are checked here, where the
user gets a message naming the input, instead of as a 400 from the service later.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from runner import tarsafe
from runner.errors import UserError
from runner.jobapi.contract import (
    DEFAULT_SOCKET,
    ENV_NAME,
    KEEP_VALUES,
    MAX_POLICY_BYTES,
    MAX_TOKEN,
    RUNNER_TOKEN_VARIABLE,
    SHA,
    TEMPLATE_NAME,
    JobSpec,
    ServiceContainer,
    WorkflowSecret,
    parse_services,
    parse_workflow_secrets,
)

MAX_TIMEOUT_MINUTES = 24 * 60
# The runner's own credentials: never meant for user code, and fatal in a fork's hands.
_FORBIDDEN_ENV = re.compile(rf"ACTIONS_.*|GITHUB_TOKEN|{RUNNER_TOKEN_VARIABLE}", re.IGNORECASE)


@dataclass(frozen=True)
class Inputs:
    run: str
    working_directory: str
    policy: str
    artifacts: list[str]
    timeout_minutes: float
    template: str
    env_names: list[str]
    socket: str
    include_git: bool
    artifacts_path: str = "artifacts"
    artifacts_required: bool = False
    keep: str = "none"  # "job": the VM stays for this job's next step (docs/job-api.md, "One VM across steps")
    size: str | None = None  # a size class of the service (docs/docker.md, "Sizes"); None: the template's own
    services: tuple[ServiceContainer, ...] = ()  # containers started in the VM before `run` (docs/docker.md)
    # Secret bindings of the workflow (docs/secrets.md), values read from the step's environment; never in a repr.
    secrets: tuple[WorkflowSecret, ...] = field(default=(), repr=False)


def _get(environ: Mapping[str, str], name: str, default: str = "") -> str:
    return environ.get(f"INPUT_{name.upper().replace('-', '_')}", default).strip()


def debug_refusal(environ: Mapping[str, str]) -> str | None:
    """Why the `debug` input keeps no VM, when a workflow set it (None when it did not)."""
    if _get(environ, "debug").lower() in ("", "false", "0", "no", "off"):
        return None
    return ("input 'debug' is ignored: a workflow (which a pull request can change) never keeps a VM; a failed "
            "job's VM is kept only when the repository's trusted file (the operator's store, or .github/microvm-"
            "check.yml on the default branch) or the operator's config says debug: (docs/debugging.md)")


def read_inputs(environ: Mapping[str, str]) -> Inputs:
    run = environ.get("INPUT_RUN", "")
    if not run.strip():
        raise UserError("input 'run' is required: the command to run in the VM, e.g. `run: pytest -q`")
    return Inputs(
        run=run,
        working_directory=_working_directory(_get(environ, "working-directory", ".") or "."),
        policy=environ.get("INPUT_POLICY", ""),
        artifacts=_artifact_globs(_get(environ, "artifacts")),
        timeout_minutes=_timeout(_get(environ, "timeout-minutes", "10") or "10"),
        template=_template(_get(environ, "template", "base") or "base"),
        env_names=_env_names(_get(environ, "env")),
        socket=_get(environ, "socket", DEFAULT_SOCKET) or DEFAULT_SOCKET,
        include_git=_boolean("include-git", _get(environ, "include-git", "false") or "false"),
        artifacts_path=_artifacts_path(_get(environ, "artifacts-path", "artifacts") or "artifacts"),
        artifacts_required=_boolean("artifacts-required", _get(environ, "artifacts-required", "false") or "false"),
        keep=_keep(_get(environ, "keep", "none") or "none"),
        size=_size(_get(environ, "size")),
        services=_services(environ.get("INPUT_SERVICES", "")),
        secrets=_secrets(environ.get("INPUT_SECRETS", ""), environ, _env_names(_get(environ, "env"))),
    )


MAX_SECRETS_TEXT = 16 * 1024


def _secrets(text: str, environ: Mapping[str, str], env_names: list[str]) -> tuple[WorkflowSecret, ...]:
    """The `secrets:` input: inline YAML, a mapping of binding name -> {env, host, ports, methods, paths,
    scheme, user, header, value-from}; `value-from` names a variable of this step's environment that holds
    the value (the workflow sets it from `${{ secrets.X }}`): a value pasted into the YAML text would be
    YAML, and one quote or `#` in it would change what the binding says. Never a file of the checkout,
    which is the pull request's. Errors name the binding and never show a value."""
    if not text.strip():
        return ()
    if len(text.encode()) > MAX_SECRETS_TEXT:
        raise UserError(f"input 'secrets' is larger than {MAX_SECRETS_TEXT} bytes")
    try:
        items = yaml.load(text, Loader=_NoAliases)
    except yaml.YAMLError as exc:
        raise UserError(f"input 'secrets' is not valid YAML ({type(exc).__name__}); write a mapping of binding "
                        "name to {env, host, paths, scheme, value-from}, as in docs/secrets.md") from None
    except RecursionError:
        raise UserError("input 'secrets' is nested too deeply: a mapping of binding name to its fields") from None
    if not isinstance(items, dict):
        raise UserError("input 'secrets' must be inline YAML: a mapping of binding name to {env, host, paths, scheme, "
                        "value-from} (never a file of the checkout, which the pull request may change)")
    bindings = []
    for name, fields in items.items():
        shown = str(name)[:40]
        if not isinstance(fields, dict):
            raise UserError(f"input 'secrets': binding {shown!r} must be a mapping of env, host, paths, scheme, "
                            "value-from")
        given = {str(k).replace("-", "_"): v for k, v in fields.items()}
        if "value" in given:
            raise UserError(f"input 'secrets': binding {shown!r}: give value-from (a variable of this step's env: "
                            "that holds ${{ secrets.X }}), not the value itself in the YAML")
        source = given.pop("value_from", None)
        if not isinstance(source, str) or not ENV_NAME.fullmatch(source):
            raise UserError(f"input 'secrets': binding {shown!r} needs value-from: the name of a variable of this "
                            "step's env: that holds the value (e.g. NPM_TOKEN_VALUE: ${{ secrets.NPM_TOKEN }})")
        if source in env_names:
            raise UserError(f"input 'secrets': binding {shown!r}: {source} is also named in input 'env', which would "
                            "put the value itself into the VM; leave it out of 'env'")
        value = environ.get(source, "")
        if not value:
            raise UserError(f"input 'secrets': binding {shown!r}: {source} is empty or not set in this step's env "
                            "(a secret GitHub does not give this workflow, such as a fork's pull_request, is empty)")
        bindings.append({**given, "name": name, "value": value})
    try:
        return parse_workflow_secrets(bindings)
    except ValueError as exc:
        raise UserError(f"input 'secrets': {exc}") from None


MAX_SERVICES_TEXT = 64 * 1024


class _NoAliases(yaml.SafeLoader):
    """YAML without anchors and aliases: a few bytes of aliases can expand to gigabytes on the host."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("aliases (*name) are not allowed here")
        return super().compose_node(parent, index)


def _services(text: str) -> tuple[ServiceContainer, ...]:
    """The `services:` input: a YAML list of {name, image or build, env, ports, ready, ready-timeout-seconds}."""
    if not text.strip():
        return ()
    if len(text.encode()) > MAX_SERVICES_TEXT:
        raise UserError(f"input 'services' is larger than {MAX_SERVICES_TEXT} bytes")
    try:
        items = yaml.load(text, Loader=_NoAliases)  # a SafeLoader without aliases
    except yaml.YAMLError as exc:
        raise UserError(f"input 'services' is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise UserError("input 'services' is nested too deeply: give a flat list of services "
                        "(each a mapping of name, image or build, env, ports, ready)") from None
    if isinstance(items, list):
        items = [{str(k).replace("-", "_"): v for k, v in item.items()} if isinstance(item, dict) else item
                 for item in items]
    try:
        return parse_services(items)
    except ValueError as exc:
        raise UserError(f"input 'services': {exc}") from None


SIZE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")


def _size(value: str) -> str | None:
    if not value:
        return None
    if not SIZE_NAME.fullmatch(value):
        raise UserError(f"input 'size' must be a size class name of the service (lowercase letters, digits, '-'), "
                        f"got {value!r}")
    return value


def _keep(value: str) -> str:
    if value not in KEEP_VALUES:
        raise UserError(f"input 'keep' must be 'job' (keep the VM for this job's next step) or 'none' "
                        f"(the default: a kept VM ends with this step), got {value!r}")
    return value


def _working_directory(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or "\0" in value:
        raise UserError(f"input 'working-directory' must be a relative path inside the checkout, got {value!r}")
    if tarsafe.refused_name(str(path)):
        raise UserError(f"input 'working-directory' may not be or be inside a .git directory, got {value!r}")
    return str(path)


def _artifacts_path(value: str) -> str:
    """Where artifacts land in the workspace: a new directory, never `.git`, never the checkout's root."""
    try:
        name = tarsafe.safe_name(value)
    except tarsafe.UnsafeTar as exc:
        raise UserError(f"input 'artifacts-path' must be a relative path inside the workspace ({exc})") from None
    if not name or tarsafe.refused_name(name):
        raise UserError(f"input 'artifacts-path' must name a new directory in the workspace, outside .git, got {value!r}")
    return name


def _artifact_globs(value: str) -> list[str]:
    globs = [line.strip() for line in value.splitlines() if line.strip()]
    for glob in globs:
        try:
            tarsafe.safe_name(glob)
        except tarsafe.UnsafeTar as exc:
            raise UserError(f"input 'artifacts': {glob!r} is not a relative glob inside the checkout ({exc})") from None
    return globs


def _timeout(value: str) -> float:
    try:
        minutes = float(value)
    except ValueError:
        raise UserError(f"input 'timeout-minutes' must be a number, got {value!r}") from None
    if not 0 < minutes <= MAX_TIMEOUT_MINUTES:
        raise UserError(f"input 'timeout-minutes' must be between 0 and {MAX_TIMEOUT_MINUTES}, got {value}")
    return minutes


def _template(value: str) -> str:
    if not TEMPLATE_NAME.fullmatch(value):
        raise UserError(f"input 'template' must be a template name (letters, digits, '.', '_', '-'), got {value!r}")
    return value


def _env_names(value: str) -> list[str]:
    names = [name for name in re.split(r"[\s,]+", value) if name]
    for name in names:
        if not ENV_NAME.fullmatch(name):
            raise UserError(f"input 'env': {name!r} is not a variable name")
        if _FORBIDDEN_ENV.fullmatch(name):
            raise UserError(f"input 'env': {name} is the runner's own credential or setting and never "
                            "enters the VM; pass a narrower secret under another name if the job needs one")
    return names


def runner_token(environ: Mapping[str, str]) -> str | None:
    """A fleet runner's credential (the service wrote it into the runner's `.env`), sent to the service
    with every request and nowhere else: never in a message, never into the VM (see `_env_names`)."""
    token = environ.get(RUNNER_TOKEN_VARIABLE, "").strip()
    if not token:
        return None
    if len(token) > MAX_TOKEN or not token.isascii() or not token.isprintable():
        raise UserError(f"{RUNNER_TOKEN_VARIABLE} is not a runner token: the runner's .env is damaged")
    return token


def _boolean(name: str, value: str) -> bool:
    if value.lower() in ("true", "yes", "1"):
        return True
    if value.lower() in ("false", "no", "0"):
        return False
    raise UserError(f"input '{name}' must be true or false, got {value!r}")


def policy_text(value: str, workspace: Path) -> str | None:
    """The policy input: inline YAML, or the path of a file in the checkout (which may only narrow)."""
    if not value.strip():
        return None
    if "\n" in value.strip() or ":" in value:
        return value
    root = workspace.resolve()
    path = (root / value.strip()).resolve()
    if root not in path.parents or not path.is_file():
        raise UserError(f"input 'policy': {value.strip()} is neither YAML nor a file inside the checkout")
    if path.stat().st_size > MAX_POLICY_BYTES:
        raise UserError(f"input 'policy': {value.strip()} is larger than {MAX_POLICY_BYTES} bytes")
    return path.read_text(encoding="utf-8", errors="replace")


def _event(environ: Mapping[str, str]) -> dict[str, Any]:
    path = environ.get("GITHUB_EVENT_PATH")
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            event = json.load(handle)
    except (OSError, ValueError):
        return {}
    return event if isinstance(event, dict) else {}


def head_sha(environ: Mapping[str, str]) -> str:
    """The pull request's head commit when there is one (checks attach to it), else GITHUB_SHA."""
    pull = _event(environ).get("pull_request")
    sha = pull.get("head", {}).get("sha") if isinstance(pull, dict) else None
    if isinstance(sha, str) and SHA.fullmatch(sha):
        return sha
    return environ.get("GITHUB_SHA", "")


def from_fork(environ: Mapping[str, str]) -> bool:
    """Whether the event is a pull request whose head is in another repository than its base."""
    pull = _event(environ).get("pull_request")
    if not isinstance(pull, dict):
        return False
    head, base = pull.get("head"), pull.get("base")
    names = [side.get("repo", {}).get("full_name") if isinstance(side, dict) and isinstance(side.get("repo"), dict)
             else None for side in (head, base)]
    return names[0] is None or names[0] != names[1]


def _required(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "")
    if not value:
        raise UserError(f"{name} is not set: run this action in a GitHub Actions job "
                        "(or set the GITHUB_* variables yourself)")
    return value


def _number(environ: Mapping[str, str], name: str, default: str) -> int:
    value = environ.get(name, default) or default
    if not value.isdigit():
        raise UserError(f"{name} must be a number, got {value!r}")
    return int(value)


def job_spec(inputs: Inputs, environ: Mapping[str, str], workspace: Path) -> JobSpec:
    """The JobSpec of docs/job-api.md for this step."""
    missing = [name for name in inputs.env_names if name not in environ]
    if missing:
        raise UserError(f"input 'env' names {', '.join(missing)}, not set in this step's environment: "
                        "set them with `env:` on the step")
    return JobSpec(
        repository=_required(environ, "GITHUB_REPOSITORY"),
        sha=head_sha(environ) or _required(environ, "GITHUB_SHA"),
        fork=from_fork(environ),
        ref=environ.get("GITHUB_REF", ""),
        event=environ.get("GITHUB_EVENT_NAME", ""),
        run_id=_number(environ, "GITHUB_RUN_ID", "0"),
        run_attempt=_number(environ, "GITHUB_RUN_ATTEMPT", "1"),
        job_name=environ.get("GITHUB_JOB", ""),
        runner_name=environ.get("RUNNER_NAME", ""),
        command=inputs.run,
        working_directory=inputs.working_directory,
        env={name: environ[name] for name in inputs.env_names},
        artifacts=tuple(inputs.artifacts),
        timeout_seconds=max(1, round(inputs.timeout_minutes * 60)),
        template=inputs.template,
        size=inputs.size,
        services=inputs.services,
        policy=policy_text(inputs.policy, workspace),
        keep=inputs.keep,
        secrets=inputs.secrets,
    )
