"""Reading a policy file: YAML text in, a `Policy` or one `PolicyError` listing every problem out.

Policy files come from repositories and pull requests, so the loader treats them as hostile: the
size, nesting and number of rules are bounded, anchors and aliases are refused (they are how a
small file expands into a huge tree), and nothing but plain scalars, lists and mappings is read.
It composes the YAML node tree (`policy.yamldoc`, shared with the config loaders) instead of calling
`safe_load` so that every problem can name the line and column it comes from, and so that duplicate
keys (which YAML silently collapses) are seen.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from ipaddress import ip_address, ip_network
from pathlib import Path

import yaml

from policy.model import (
    HTTP_METHODS,
    SUPPORTED_VERSION,
    Mode,
    Network,
    OnBlock,
    Policy,
    Protocol,
    Rule,
    is_mode,
    is_on_block,
    is_protocol,
)
from policy.reserved import reserved_containing
from policy.yamldoc import (
    BOOL_TAG,
    STR_TAG,
    DocumentLimits,
    Problem,
    Problems,
    all_or_none,
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
from runner.errors import MicrovmCheckError

MAX_BYTES = 256 * 1024
MAX_RULES = 256
MAX_PORTS_PER_RULE = 128
MAX_DEPTH = 16
MAX_PROBLEMS = 100
LIMITS = DocumentLimits("policy", MAX_BYTES, MAX_DEPTH, "a policy is a mapping with a list of flat entries", MAX_PROBLEMS)

TOP_KEYS = ("version", "mode", "allow", "on_block")
RULE_KEYS = ("host", "cidr", "ports", "protocol", "raw", "methods", "paths")
MAX_PATHS_PER_RULE = 64
MAX_PATH_GLOB = 256
EXAMPLE = "'version: 1', 'mode: block' and an 'allow' list of entries like {host: pypi.org, ports: [443]}"

_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


class PolicyError(MicrovmCheckError):
    """Every problem found in one policy, in file order; `str()` prints them like a linter."""

    def __init__(self, problems: list[Problem]):
        self.problems = sort_problems(problems)
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(str(problem) for problem in self.problems)


Section = Callable[[yaml.Node, Problems], None]


def load_policy(source: str | Path, source_name: str | None = None, sections: dict[str, Section] | None = None) -> Policy:
    """Load a policy from a file (`Path`) or from YAML text (`str`).

    `source_name` is what problems are reported against (defaults to the path, or `<policy>` for
    text). `sections` are further top-level keys this file may have, each read by its function
    (`policy.warm`: a repository's trusted file has `warm:`, a job's policy never). Raises
    `PolicyError` for anything wrong, including unreadable files; never anything else.
    """
    name = source_name or (str(source) if isinstance(source, Path) else "<policy>")
    problems = Problems(name, MAX_PROBLEMS)
    text = read_text(source, LIMITS, problems) if isinstance(source, Path) else source
    policy = _parse_policy(text, problems, sections or {}) if text is not None else None
    if problems.items or policy is None:
        raise PolicyError(problems.final())
    return policy


def _parse_policy(text: str, problems: Problems, sections: dict[str, Section]) -> Policy | None:
    node = compose(text, LIMITS, problems)
    if problems.items:
        return None
    if node is None or is_null(node):
        problems.add_at(1, 1, f"the policy is empty; write {EXAMPLE}")
        return None
    return _policy(node, problems, sections)


def _policy(node: yaml.Node, problems: Problems, sections: dict[str, Section]) -> Policy | None:
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"the policy must be a mapping with keys version, mode and allow, "
                          f"not {kind(node)}; write {EXAMPLE}")
        return None
    values, duplicates = mapping(_without_secrets(node, problems), TOP_KEYS + tuple(sections), "the policy", problems)
    checks: dict[str, Callable[[yaml.Node], object]] = {
        "version": lambda value: _version(value, node, problems),
        "mode": lambda value: _mode(value, problems),
        "allow": lambda value: _rules(value, problems),
        "on_block": lambda value: _on_block(value, problems),
    }
    for key, value in duplicates:
        if key in checks:
            checks[key](value)
        else:
            sections[key](value, problems)
    for key, read in sections.items():
        if key in values:
            read(values[key], problems)
    version = _version(values.get("version"), node, problems)
    mode = _mode(values.get("mode"), problems)
    rules = _rules(values.get("allow"), problems)
    on_block = _on_block(values.get("on_block"), problems)
    if version is None or mode is None or rules is None or on_block is None:
        return None
    return Policy(version=version, mode=mode, rules=tuple(rules), on_block=on_block)


def _version(node: yaml.Node | None, top: yaml.Node, problems: Problems) -> int | None:
    if node is None:
        problems.at(top, f"missing 'version'; add 'version: {SUPPORTED_VERSION}' at the top")
        return None
    value = decimal_int(node)
    if value is None:
        problems.at(node, f"version: {kind(node)} is not a version; use version: {SUPPORTED_VERSION} (a number)")
    elif value != SUPPORTED_VERSION:
        problems.at(node, f"version: {value} is not supported; this runner reads version {SUPPORTED_VERSION}")
        return None
    return value


def _mode(node: yaml.Node | None, problems: Problems) -> Mode | None:
    if node is None:
        return "block"
    value = string(node)
    if is_mode(value):
        return value
    problems.at(node, f"mode: {kind(node)} is not a mode; use block or audit")
    return None


def _on_block(node: yaml.Node | None, problems: Problems) -> OnBlock | None:
    if node is None:
        return "warn"
    value = string(node)
    if is_on_block(value):
        return value
    problems.at(node, f"on_block: {kind(node)} is not supported; use warn (list refused egress, the default) "
                      "or fail (a job whose guest had egress refused fails)")
    return None


def _rules(node: yaml.Node | None, problems: Problems) -> list[Rule] | None:
    if node is None or is_null(node):
        return []
    if not isinstance(node, yaml.SequenceNode):
        problems.at(node, "allow must be a list of entries such as '- host: pypi.org' with 'ports: [443]'")
        return None
    if len(node.value) > MAX_RULES:
        problems.at(node, f"allow has {len(node.value)} entries; at most {MAX_RULES} are allowed: "
                          "use wildcards or wider networks")
        return None
    return all_or_none([_rule(item, problems) for item in node.value])


def _without_secrets(node: yaml.MappingNode, problems: Problems) -> yaml.MappingNode:
    """The policy's mapping without a `secrets` key, which is refused with why: a secret binding
    (runner.net.secretswap) comes from the operator's config or the base branch's workflow only, and
    a policy (which a pull request may bring) can neither add one nor widen one."""
    kept = []
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "secrets":
            problems.at(key, "secrets: a policy cannot bind secrets or widen a binding; bindings come from the "
                             "operator's service config or the workflow's secrets: input (docs/secrets.md)")
        else:
            kept.append((key, value))
    return yaml.MappingNode(node.tag, kept, node.start_mark, node.end_mark)


def _rule(node: yaml.Node, problems: Problems) -> Rule | None:
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"an allow entry must be a mapping like {{host: pypi.org, ports: [443]}}, "
                          f"not {kind(node)}")
        return None
    before = len(problems.items)
    values, duplicates = mapping(node, RULE_KEYS, "an allow entry", problems)
    checks: dict[str, Callable[[yaml.Node], object]] = {
        "host": lambda value: _host(value, problems),
        "cidr": lambda value: _cidr(value, problems),
        "ports": lambda value: _ports(value, node, problems),
        "protocol": lambda value: _protocol(value, problems),
        "raw": lambda value: _raw(value, problems),
        "methods": lambda value: _methods(value, problems),
        "paths": lambda value: _paths(value, problems),
    }
    for key, value in duplicates:
        checks[key](value)
    host: str | None = None
    network: Network | None = None
    if "host" in values and "cidr" in values:
        problems.at(node, "an allow entry has both 'host' and 'cidr'; split it into two entries")
    elif "host" in values:
        host = _host(values["host"], problems)
    elif "cidr" in values:
        network = _cidr(values["cidr"], problems)
    else:
        problems.at(node, "an allow entry needs 'host' (a DNS name) or 'cidr' (a network)")
    ports = _ports(values.get("ports"), node, problems)
    protocol = _protocol(values.get("protocol"), problems)
    raw = _raw(values.get("raw"), problems)
    if raw and "raw" in values and ("host" not in values or protocol != "tcp"):
        problems.at(values["raw"], "raw: true applies to a tcp host entry only; cidr: and udp entries are "
                                   "enforced by address already, so drop it")
    methods = _methods(values.get("methods"), problems)
    paths = _paths(values.get("paths"), problems)
    for key in ("methods", "paths"):
        if key in values and ("host" not in values or protocol != "tcp" or raw):
            problems.at(values[key], f"{key}: applies to a tcp host entry that is not raw: only there does the "
                                     "host read each request")
    if len(problems.items) != before or ports is None or (host is None and network is None):
        return None
    return Rule(ports=ports, protocol=protocol, host=host, network=network, raw=raw, methods=methods, paths=paths)


def _methods(node: yaml.Node | None, problems: Problems) -> frozenset[str]:
    """`methods: [GET, HEAD]`: the HTTP methods a host entry's requests may use (HEAD comes with GET)."""
    if node is None:
        return frozenset()
    items = node.value if isinstance(node, yaml.SequenceNode) else None
    if not items:
        problems.at(node, f"methods must be a non-empty list such as [GET, HEAD]; known: {', '.join(HTTP_METHODS)}")
        return frozenset()
    found: set[str] = set()
    for item in items:
        value = string(item)
        if value is None or value not in HTTP_METHODS:
            problems.at(item, f"methods: {kind(item)} is not an HTTP method; use {', '.join(HTTP_METHODS)} (upper case)")
        else:
            found.add(value)
    return frozenset(found)


def _paths(node: yaml.Node | None, problems: Problems) -> tuple[str, ...]:
    """`paths: ["/simple/*"]`: globs the URL path (no query) must match; `*` spans `/` too."""
    if node is None:
        return ()
    items = node.value if isinstance(node, yaml.SequenceNode) else None
    if not items or len(items) > MAX_PATHS_PER_RULE:
        problems.at(node, f'paths must be a list of 1..{MAX_PATHS_PER_RULE} globs such as ["/simple/*"]')
        return ()
    found: list[str] = []
    for item in items:
        value = string(item)
        if value is None or not value.startswith("/") or len(value) > MAX_PATH_GLOB \
                or any(char.isspace() or not char.isprintable() for char in value):
            problems.at(item, f"paths: {kind(item)} is not a path glob; write one like \"/simple/*\" (starting "
                              f"with /, at most {MAX_PATH_GLOB} characters, no spaces)")
        else:
            found.append(value)
    return tuple(found)


def _raw(node: yaml.Node | None, problems: Problems) -> bool:
    """`raw: true` opts a host entry out of the name check (see `policy.model.Rule`)."""
    if node is None:
        return False
    value = node.value if isinstance(node, yaml.ScalarNode) and node.tag == BOOL_TAG else None
    if value in ("true", "false"):
        return bool(value == "true")
    problems.at(node, f"raw: {kind(node)} is not true or false; write raw: true to enforce this entry by "
                      "address only (raw TCP such as ssh), or leave it out")
    return False


def raw_warnings(policy: Policy) -> list[str]:
    """What `policy check` says about the rules that are enforced by address, not by name, and
    where such a rule gives way to a name-checked one (`policy.render.namecheck_lines`)."""
    warnings = []
    for rule in policy.rules:
        if not rule.raw:
            continue
        warnings.append(f"warning: {rule.host} ports {_port_list(rule.ports)} is raw: enforced by address only, so any "
                        "name served at the addresses it resolves to is reachable on those ports")
        for checked in policy.rules:
            shared = rule.ports & checked.ports if checked.name_checked else frozenset()
            if shared:
                warnings.append(
                    f"warning: {rule.host} (raw) and {checked.host} (checked by name) share port(s) {_port_list(shared)}: "
                    f"where both resolve to one address, the stricter wins and that address is checked on "
                    f"them, so {rule.host} is reached there only by a name a checked rule allows")
    return warnings


def _port_list(ports: frozenset[int]) -> str:
    return ",".join(map(str, sorted(ports)))


def _host(node: yaml.Node, problems: Problems) -> str | None:
    value = string(node)
    if value is None:
        problems.at(node, f"host: {kind(node)} is not a host name; write a name such as pypi.org")
        return None
    error = host_error(value)
    if error:
        problems.at(node, f"host: {error}")
        return None
    return value.lower()


def host_error(value: str) -> str | None:
    """Why `value` is not a valid host pattern, or None when it is."""
    name = value.lower()
    if "*" in name:
        base = name[2:]
        if not name.startswith("*.") or "*" in base:
            return f"{quote(value)} is a bad wildcard; only a leading '*.' label is allowed, like '*.example.org'"
        if base.count(".") < 1:
            return (f"{quote(value)} would match a whole top-level domain; name a domain under it, "
                    "like '*.example.org' (or use cidr: 0.0.0.0/0 if you mean everything)")
        return _name_error(value, base)
    return _name_error(value, name)


def _name_error(value: str, name: str) -> str | None:
    try:
        ip_address(name)
        return f"{quote(value)} is an IP address; use cidr: {value}/{32 if ':' not in name else 128} instead"
    except ValueError:
        pass
    if name.endswith("."):
        return f"{quote(value)} ends with a dot; drop the trailing dot"
    if not name or len(name) > 253:
        return f"{quote(value)} is not a DNS name (1..253 characters)"
    labels = name.split(".")
    for label in labels:
        if not _LABEL.fullmatch(label):
            return (f"{quote(value)} has an invalid label {quote(label)}; labels are 1..63 letters, digits "
                    "and inner hyphens")
    if labels[-1].isdigit():
        return f"{quote(value)} ends in a numeric label, which no DNS name does; check for a typo"
    return None


def _cidr(node: yaml.Node, problems: Problems) -> Network | None:
    value = string(node)
    if value is None:
        problems.at(node, f"cidr: {kind(node)} is not a network; write one like 10.20.0.0/16 (in quotes if needed)")
        return None
    try:
        network = ip_network(value)
    except ValueError:
        problems.at(node, f"cidr: {_cidr_error(value)}")
        return None
    reserved = reserved_containing(network)
    if reserved is not None:
        problems.at(node, f"cidr: {network} lies inside {reserved.what}, which is always denied to "
                          "guests; only the runner operator's config can allow it")
        return None
    return network


def _cidr_error(value: str) -> str:
    try:
        return f"{quote(value)} has host bits set; did you mean {ip_network(value, strict=False)}?"
    except ValueError:
        return f"{quote(value)} is not a network; write one like 10.20.0.0/16 or 2001:db8::/32"


def _ports(node: yaml.Node | None, rule: yaml.Node, problems: Problems) -> frozenset[int] | None:
    if node is None:
        problems.at(rule, "an allow entry needs 'ports', e.g. ports: [443]")
        return None
    if not isinstance(node, yaml.SequenceNode):
        hint = f"ports: [{node.value}]" if decimal_int(node) is not None else "ports: [443]"
        problems.at(node, f"ports must be a list; write {hint}")
        return None
    if not node.value:
        problems.at(node, "ports is empty; list at least one port, e.g. [443]")
        return None
    if len(node.value) > MAX_PORTS_PER_RULE:
        problems.at(node, f"ports lists {len(node.value)} ports; at most {MAX_PORTS_PER_RULE} per entry")
        return None
    ports = all_or_none([_port(item, problems) for item in node.value])
    return None if ports is None else frozenset(ports)


def _port(node: yaml.Node, problems: Problems) -> int | None:
    value = decimal_int(node)
    if value is None:
        problems.at(node, f"ports: {kind(node)} is not a port number (a decimal integer 1..65535){_port_hint(node)}")
        return None
    if not 1 <= value <= 65535:
        problems.at(node, f"ports: {value} is out of range; use 1..65535")
        return None
    return value


def _port_hint(node: yaml.Node) -> str:
    if not isinstance(node, yaml.ScalarNode) or not node.value.isdigit():
        return ""
    if node.tag == STR_TAG:
        return f"; write {node.value} without quotes"
    return f"; write {node.value.lstrip('0') or '0'} without leading zeros"


def _protocol(node: yaml.Node | None, problems: Problems) -> Protocol:
    if node is None:
        return "tcp"
    value = string(node)
    if not is_protocol(value):
        problems.at(node, f"protocol: {kind(node)} is not supported; use tcp or udp")
        return "tcp"
    return value
