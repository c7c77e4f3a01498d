"""The operator's secret bindings (issue 35): the file the service config's `secrets:` names.

Each binding says which repositories' jobs get a secret, where it may be sent (`runner.net.secretswap`)
and which root-only file holds its value. The file is the operator's, like the policy store: nothing a
repository or a pull request controls can add a binding or widen one. Values are read once, at start,
into the service's memory; they are never written anywhere (not the job record, the database, a log,
the page or the signed record) and never enter a VM: the guest gets a per-job placeholder.

```yaml
bindings:
  - name: private-index             # what refusals, the job log and the docs call it
    repositories: [my-org/my-repo]  # whose jobs get it (owner/name, any letter case)
    env: PIP_INDEX_PASSWORD         # the guest's variable holding the placeholder
    host: pypi.internal.example     # an exact name the job's policy allows (name-checked, not raw)
    ports: [443]                    # default [443]
    methods: [GET]                  # default [GET] (HEAD comes with GET)
    paths: ["/simple/*", "/packages/*"]
    scheme: basic                   # bearer (Authorization: Bearer V), basic (user:V, encoded by the
    user: ci                        # host), or header (the value alone in `header`)
    header: authorization           # default authorization
    value_file: /etc/microvm-check/secrets/private-index   # root's, mode 0600 or 0400
```
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import yaml

from policy.model import HTTP_METHODS, Policy
from policy.yamldoc import (
    DocumentLimits,
    Problems,
    compose,
    decimal_int,
    is_null,
    kind,
    mapping,
    read_text,
    sort_problems,
    string,
)
from runner.errors import ConfigError
from runner.jobapi.contract import REPOSITORY, JobSpec, WorkflowSecret
from runner.net.secretswap import SCHEMES, BoundSecret, Scheme, SecretBinding, SecretBindingError, value_problem
from runner.service.jobs.jobsecrets import JobSecrets, job_secrets
from runner.service.jobs.spec import SpecError

LIMITS = DocumentLimits("secret bindings", 64 * 1024, 6, "a list of bindings under bindings:", max_problems=20)
KEYS = ("name", "repositories", "env", "host", "ports", "methods", "paths", "scheme", "user", "header", "value_file")
REQUIRED = ("name", "repositories", "env", "host", "paths", "value_file")
MAX_VALUE_FILE = 8192


@dataclass(frozen=True)
class OperatorBinding:
    """A binding, the repositories whose jobs get it, and its value (never in a repr)."""

    binding: SecretBinding
    repositories: frozenset[str]  # lower-case owner/name
    value: str

    def __repr__(self) -> str:
        return f"OperatorBinding({self.binding!r}, {sorted(self.repositories)!r})"


@dataclass(frozen=True)
class OperatorSecrets:
    """Every binding of the operator's file (none without one)."""

    bindings: tuple[OperatorBinding, ...] = ()

    def for_repository(self, repository: str) -> tuple[BoundSecret, ...]:
        """The bindings `repository`'s job gets, each with a fresh placeholder of its own."""
        wanted = repository.lower()
        return tuple(BoundSecret.make(entry.binding, entry.value) for entry in self.bindings
                     if wanted in entry.repositories)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(entry.binding.name for entry in self.bindings)


def workflow_bindings(asked: tuple[WorkflowSecret, ...], trusted: Policy, operator: tuple[BoundSecret, ...],
                      env: dict[str, str]) -> tuple[BoundSecret, ...]:
    """The workflow's bindings (the action's `secrets:` input, from a workflow `Access` trusts), checked as
    the operator's are, each for a host the repository's trusted policy (the store's, or its default
    branch's, within the org default: never the job's own) allows by a name-checked `host:` rule on every
    port it names; none may take an operator binding's name or variable (it could replace or widen it),
    nor a variable of the job's `env`. Raises SecretBindingError naming the binding, never its value."""
    taken = {bound.binding.name: bound for bound in operator}
    variables = {bound.binding.env: bound.binding.name for bound in operator}
    found = []
    for secret in asked:
        try:
            binding = SecretBinding(secret.name, secret.env, secret.host, header=secret.header,
                                    scheme=cast(Scheme, secret.scheme),  # binding_problem checks it
                                    user=secret.user, ports=frozenset(secret.ports), methods=frozenset(secret.methods),
                                    paths=secret.paths)
        except SecretBindingError as exc:
            raise SecretBindingError(f"secrets: {exc}") from None
        where = f"secrets: binding {secret.name!r}"
        if secret.name in taken or secret.env in variables:
            other = secret.name if secret.name in taken else variables[secret.env]
            raise SecretBindingError(f"{where}: the operator's binding {other!r} has this name or variable, and a "
                                     "workflow cannot replace or widen an operator's binding; choose another name and env")
        if secret.env in env:
            raise SecretBindingError(f"{where}: env {secret.env} is also a variable of the job's env; choose another")
        problem = value_problem(secret.value)
        if problem is not None:
            raise SecretBindingError(f"{where}: its value cannot be bound: {problem}")
        ports = sorted(binding.ports)
        if not all(any(rule.name_checked and rule.allows(port, "tcp", name=binding.host) for rule in trusted.rules)
                   for port in ports):
            raise SecretBindingError(f"{where}: {binding.host} on port(s) {','.join(map(str, ports))} is not allowed by "
                                     "a host: rule (name-checked, not raw) of the repository's trusted policy (the "
                                     "operator's store file, or the default branch's .github/microvm-check.yml); a "
                                     "workflow binds secrets only for hosts that policy names")
        found.append(BoundSecret.make(binding, secret.value))
    return tuple(found)


class SecretAdmission:
    """Which secret bindings an admitted job gets: the operator's for its repository (read once from the
    file `secrets:` names), and the workflow's own (the action's `secrets:` input, from a workflow `Access`
    already trusted), each checked by `workflow_bindings` against the repository's trusted policy."""

    def __init__(self, path: Path | None) -> None:
        self.operator = load_secrets(path)  # the values, in this process's memory only

    def for_job(self, spec: JobSpec, asked: tuple[WorkflowSecret, ...], trusted: Callable[[], Policy]) -> JobSecrets:
        """The job's bindings with fresh placeholders; a workflow binding that cannot be used is the
        submission's error (SpecError naming the binding, never its value)."""
        operator = self.operator.for_repository(spec.repository)
        try:
            workflow = workflow_bindings(asked, trusted(), operator, spec.env) if asked else ()
        except SecretBindingError as exc:
            raise SpecError(str(exc)) from None
        return job_secrets(operator, workflow)


def load_secrets(path: Path | None) -> OperatorSecrets:
    """The bindings in the file at `path` (None: no bindings); raises ConfigError with every problem,
    each at its file:line:column, and never quotes a value."""
    if path is None:
        return OperatorSecrets()
    problems = Problems(str(path), LIMITS.max_problems)
    text = read_text(path, LIMITS, problems)
    node = compose(text, LIMITS, problems) if text is not None else None
    found = _bindings(node, problems, path.parent) if not problems.items else None
    if problems.items or found is None:
        raise ConfigError(sort_problems(problems.final()))
    return OperatorSecrets(found)


def _bindings(node: yaml.Node | None, problems: Problems, base: Path) -> tuple[OperatorBinding, ...] | None:
    if not isinstance(node, yaml.MappingNode):
        problems.add(node.start_mark if node is not None else None, "expected a mapping with bindings: [...]")
        return None
    given, _ = mapping(node, ("bindings",), "the secret bindings", problems)
    items = given.get("bindings")
    if not isinstance(items, yaml.SequenceNode):
        problems.add(node.start_mark, "bindings: expected a list of bindings")
        return None
    found = [_binding(item, problems, base) for item in items.value]
    names = [entry.binding.name for entry in found if entry is not None]
    for item, entry in zip(items.value, found):
        if entry is not None and names.count(entry.binding.name) > 1:
            problems.at(item, f"binding {entry.binding.name!r} is given twice; each name once")
    return tuple(entry for entry in found if entry is not None) if len(names) == len(found) else None


def _binding(node: yaml.Node, problems: Problems, base: Path) -> OperatorBinding | None:
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"a binding is a mapping of {', '.join(KEYS)}, not {kind(node)}")
        return None
    before = len(problems.items)
    given, _ = mapping(node, KEYS, "a binding", problems)
    for key in REQUIRED:
        if key not in given:
            problems.at(node, f"a binding needs {key}")
    if len(problems.items) != before:
        return None
    fields = {key: _text(given[key], key, problems) for key in ("name", "env", "host", "value_file")}
    lists = {key: _texts(given[key], key, problems) for key in ("repositories", "paths", "methods") if key in given}
    ports = _ports(given["ports"], problems) if "ports" in given else frozenset({443})
    scheme = _text(given["scheme"], "scheme", problems) if "scheme" in given else "bearer"
    user = _text(given["user"], "user", problems) if "user" in given else None
    header = _text(given["header"], "header", problems) if "header" in given else "authorization"
    if len(problems.items) != before or ports is None or scheme is None or header is None:
        return None
    repositories = lists["repositories"] or ()
    for repository in repositories:
        if not REPOSITORY.fullmatch(repository):
            problems.at(given["repositories"], f"repositories: {repository!r} is not owner/name")
    if scheme not in SCHEMES:
        problems.at(given["scheme"], f"scheme: use one of {', '.join(SCHEMES)}")
        return None
    methods = lists.get("methods") or ("GET",)
    if not set(methods) <= set(HTTP_METHODS):
        problems.at(given["methods"], f"methods: use some of {', '.join(HTTP_METHODS)}")
    if len(problems.items) != before:
        return None
    try:
        binding = SecretBinding(cast(str, fields["name"]), cast(str, fields["env"]), cast(str, fields["host"]),
                                header=header, scheme=scheme, user=user, ports=ports,
                                methods=frozenset(methods), paths=tuple(lists["paths"] or ()))
    except SecretBindingError as exc:
        problems.at(node, str(exc))
        return None
    value = _value(base / cast(str, fields["value_file"]), given["value_file"], binding.name, problems)
    if value is None:
        return None
    return OperatorBinding(binding, frozenset(repository.lower() for repository in repositories), value)


def _value(path: Path, node: yaml.Node, name: str, problems: Problems) -> str | None:
    """The value in `path`, which must be a regular file of root's that only root may read or write
    (one trailing newline is dropped); None after a problem, which never quotes the file's content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        problems.at(node, f"value_file of {name!r}: cannot open {path}: {exc.strerror}")
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o077:
            problems.at(node, f"value_file of {name!r}: {path} must be a regular file owned by root that only root "
                              f"may read (chown root {path} && chmod 600 {path})")
            return None
        data = os.read(fd, MAX_VALUE_FILE + 1)
    finally:
        os.close(fd)
    try:
        value = data.decode("ascii").removesuffix("\n")
    except UnicodeDecodeError:
        value = "\0"
    problem = value_problem(value) if len(data) <= MAX_VALUE_FILE else "the file is too large"
    if problem is not None:
        problems.at(node, f"value_file of {name!r}: {path}: {problem}")
        return None
    return value


def _text(node: yaml.Node, key: str, problems: Problems) -> str | None:
    value = string(node)
    if value is None or not value:
        problems.at(node, f"{key}: expected a string, not {kind(node)}")
    return value


def _texts(node: yaml.Node, key: str, problems: Problems) -> tuple[str, ...] | None:
    if not isinstance(node, yaml.SequenceNode) or not node.value or is_null(node):
        problems.at(node, f"{key}: expected a list of strings")
        return None
    values = [_text(item, key, problems) for item in node.value]
    return tuple(value for value in values if value is not None)


def _ports(node: yaml.Node, problems: Problems) -> frozenset[int] | None:
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        problems.at(node, "ports: expected a list of port numbers like [443]")
        return None
    ports = [decimal_int(item) for item in node.value]
    if any(port is None or not 1 <= port <= 65535 for port in ports):
        problems.at(node, "ports: every port is a number in 1..65535")
        return None
    return frozenset(port for port in ports if port is not None)
