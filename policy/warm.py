"""A repository's `warm:` section: how the service builds the repository's warm base.

It sits in the repository's trusted file, next to its egress policy: the operator's store file
(`<owner>/<repo>.yml`) or, without one, `.github/microvm-check.yml` on the default branch. Never in a
job's policy (a pull request's), whose loader does not know the key:

    version: 1
    allow: [{host: pypi.org, ports: [443]}]
    warm:
      setup: python3 -m venv /opt/venv && /opt/venv/bin/pip install -r requirements.txt
      inputs: [requirements*.txt, pyproject.toml, wheels/*.whl]  # their content keys the base
      policy: {allow: [{host: pypi.org, ports: [443]}]}             # egress for the setup only

An input is a path relative to the checkout whose last part may hold `*`, `?` or `[...]`: the
service lists one directory per input (the contents API), so directories are named literally.
`policy` has the shape of a policy without `version`; it is intersected with the org default,
never with the repository's own policy (the setup may fetch what jobs may not). No `policy`:
the setup runs without network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from policy.load import _mode, _rules, load_policy
from policy.model import DENY_ALL, SUPPORTED_VERSION, Policy
from policy.yamldoc import BOOL_TAG, Problems, all_or_none, decimal_int, is_null, kind, mapping, string

MAX_SETUP_CHARS = 8192
MAX_INPUTS = 32
MAX_INPUT_CHARS = 255
WARM_KEYS = ("setup", "inputs", "policy")
SETUP_POLICY_KEYS = ("mode", "allow")
_WILDCARD = re.compile(r"[*?\[]")
_PART = re.compile(r"[^/\0]+")


@dataclass(frozen=True)
class WarmSpec:
    setup: str
    inputs: tuple[str, ...]
    policy: Policy  # the setup's own egress, before the org default narrows it

    def directories(self) -> tuple[str, ...]:
        """The directories whose listings decide the inputs ("" is the checkout's root)."""
        return tuple(dict.fromkeys(pattern.rpartition("/")[0] for pattern in self.inputs))


@dataclass(frozen=True)
class RepositoryFile:
    """A repository's trusted file: its egress policy, its `warm:` section if it has one, and its
    `checks:` setting (on, off or forks: whether the service posts a check run per job on the pull
    request, runner/github/checks.py; None: not set, off)."""

    policy: Policy
    warm: WarmSpec | None
    checks: str | None = None
    # The size classes (the service config's `sizes:`) this repository's jobs may ask for with `size:`;
    # none: only the template's own size. Read from the operator's store only, never from a repository.
    sizes: tuple[str, ...] = ()
    # `debug:` (issue 37, docs/debugging.md): how long the VM of a failed or timed-out job is kept for the
    # operator to attach to, in seconds; None: not set (no keep). Held to the service config's debug section.
    debug_seconds: int | None = None
    # Templates this repository's jobs may name beyond those the service offers every repository (an image
    # template built for its toolchain, docs/images.md). Read from the operator's store only, like sizes.
    templates: tuple[str, ...] = ()


CHECKS_SETTINGS = ("on", "off", "forks")


def load_repository_file(source: str | Path, source_name: str | None = None) -> RepositoryFile:
    """Load a repository's trusted file; `PolicyError` (file:line: problem) for anything wrong."""
    found: list[WarmSpec | None] = []
    checks: list[str | None] = []
    sizes: list[tuple[str, ...]] = []
    debug: list[int | None] = []
    templates: list[tuple[str, ...]] = []
    loaded = load_policy(source, source_name, {
        "warm": lambda node, problems: found.append(_warm(node, problems)),
        "checks": lambda node, problems: checks.append(_checks(node, problems)),
        "sizes": lambda node, problems: sizes.append(_sizes(node, problems)),
        "debug": lambda node, problems: debug.append(_debug(node, problems)),
        "templates": lambda node, problems: templates.append(_templates(node, problems))})
    return RepositoryFile(loaded, found[0] if found else None, checks[0] if checks else None,
                          sizes[0] if sizes else (), debug[0] if debug else None, templates[0] if templates else ())


DEBUG_DEFAULT_SECONDS = 900
DEBUG_MAX_SECONDS = 86400
DEBUG_KEYS = ("keep_seconds",)


def _debug(node: yaml.Node, problems: Problems) -> int | None:
    """`debug: true` (keep a failed job's VM DEBUG_DEFAULT_SECONDS), `debug: false`, or
    `debug: {keep_seconds: N}`; 0 keeps nothing."""
    if isinstance(node, yaml.ScalarNode) and node.tag == BOOL_TAG:
        return DEBUG_DEFAULT_SECONDS if str(node.value).lower() in ("true", "yes", "on") else 0
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, "debug must be true, false or a mapping {keep_seconds: N}: how long the VM of a failed "
                          "or timed-out job is kept for the operator to attach to")
        return None
    values, duplicates = mapping(node, DEBUG_KEYS, "debug", problems)
    seconds = values.get("keep_seconds")
    if seconds is None:
        return None if duplicates else DEBUG_DEFAULT_SECONDS
    value = decimal_int(seconds)
    if value is None or not 0 <= value <= DEBUG_MAX_SECONDS:
        problems.at(seconds, f"debug.keep_seconds must be a whole number of seconds from 0 to {DEBUG_MAX_SECONDS} "
                             "(the service config's debug.max_keep_seconds bounds it further)")
        return None
    return None if duplicates else value


SIZE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")


def _sizes(node: yaml.Node, problems: Problems) -> tuple[str, ...]:
    names = [item.value for item in node.value if isinstance(item, yaml.ScalarNode)] \
        if isinstance(node, yaml.SequenceNode) else None
    if names is None or len(names) != len(node.value) or len(names) > 64 \
            or not all(isinstance(n, str) and SIZE_NAME.fullmatch(n) for n in names):
        problems.at(node, "sizes must be a list of size class names (lowercase letters, digits, '-'; the service "
                          "config's sizes:) that this repository's jobs may ask for")
        return ()
    return tuple(names)


TEMPLATE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,199}")  # runner.vm.templates.NAME


def _templates(node: yaml.Node, problems: Problems) -> tuple[str, ...]:
    names = [item.value for item in node.value if isinstance(item, yaml.ScalarNode)] \
        if isinstance(node, yaml.SequenceNode) else None
    if names is None or len(names) != len(node.value) or len(names) > 64 \
            or not all(isinstance(n, str) and TEMPLATE_NAME.fullmatch(n) for n in names):
        problems.at(node, "templates must be a list of template names (lowercase letters, digits, '.', '_', '-'; "
                          "microvm-check template list) that this repository's jobs may name beyond those the "
                          "service config's templates: offers every repository")
        return ()
    return tuple(names)


def _checks(node: yaml.Node, problems: Problems) -> str | None:
    if not isinstance(node, yaml.ScalarNode) or node.value not in CHECKS_SETTINGS:
        problems.at(node, f"checks must be one of {', '.join(CHECKS_SETTINGS)} (a check run per job on the pull "
                          "request: always, never, or only for pull requests from forks)")
        return None
    return str(node.value)


def _warm(node: yaml.Node, problems: Problems) -> WarmSpec | None:
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"warm must be a mapping with 'setup' (a command) and 'inputs' (a list of file "
                          f"patterns), not {kind(node)}")
        return None
    values, duplicates = mapping(node, WARM_KEYS, "warm", problems)
    setup = _setup(values.get("setup"), node, problems)
    inputs = _inputs(values.get("inputs"), node, problems)
    setup_policy = _setup_policy(values.get("policy"), problems)
    if duplicates or setup is None or inputs is None or setup_policy is None:
        return None
    return WarmSpec(setup, inputs, setup_policy)


def _setup(node: yaml.Node | None, warm: yaml.Node, problems: Problems) -> str | None:
    if node is None:
        problems.at(warm, "warm needs 'setup': the command that installs what jobs need, e.g. "
                          "'pip install -r requirements.txt'")
        return None
    value = string(node)
    if value is None or not value.strip() or "\0" in value:
        problems.at(node, f"warm.setup: {kind(node)} is not a command; write one shell command line")
        return None
    if len(value) > MAX_SETUP_CHARS:
        problems.at(node, f"warm.setup is {len(value)} characters; at most {MAX_SETUP_CHARS}: put a script in "
                          "the repository and run that")
        return None
    return value


def _inputs(node: yaml.Node | None, warm: yaml.Node, problems: Problems) -> tuple[str, ...] | None:
    if node is None or is_null(node):
        problems.at(warm, "warm needs 'inputs': the files whose content the base depends on, e.g. "
                          "[requirements*.txt, pyproject.toml]")
        return None
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        problems.at(node, "warm.inputs must be a non-empty list of file patterns, e.g. [requirements*.txt]")
        return None
    if len(node.value) > MAX_INPUTS:
        problems.at(node, f"warm.inputs lists {len(node.value)} patterns; at most {MAX_INPUTS}")
        return None
    patterns = all_or_none([_input(item, problems) for item in node.value])
    return None if patterns is None else tuple(dict.fromkeys(patterns))


def _input(node: yaml.Node, problems: Problems) -> str | None:
    value = string(node)
    if value is None or not value or len(value) > MAX_INPUT_CHARS:
        problems.at(node, f"warm.inputs: {kind(node)} is not a file pattern (1..{MAX_INPUT_CHARS} characters)")
        return None
    parts = value.split("/")
    if value.startswith("/") or any(not _PART.fullmatch(p) or p in (".", "..") for p in parts):
        problems.at(node, f"warm.inputs: {value[:80]!r} is not a path inside the checkout; write it relative to "
                          "the repository's root, without '.', '..' or empty parts")
        return None
    if any(_WILDCARD.search(p) for p in parts[:-1]):
        problems.at(node, f"warm.inputs: {value[:80]!r} has a wildcard in a directory; only the file name may "
                          "have one (e.g. 'wheels/*.whl'): name the directories")
        return None
    return value


def _setup_policy(node: yaml.Node | None, problems: Problems) -> Policy | None:
    if node is None or is_null(node):
        return DENY_ALL
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"warm.policy must be a mapping with 'allow' (and 'mode'), not {kind(node)}")
        return None
    values, duplicates = mapping(node, SETUP_POLICY_KEYS, "warm.policy", problems)
    mode, rules = _mode(values.get("mode"), problems), _rules(values.get("allow"), problems)
    if duplicates or mode is None or rules is None:
        return None
    return Policy(version=SUPPORTED_VERSION, mode=mode, rules=tuple(rules))
