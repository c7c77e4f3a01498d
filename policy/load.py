"""Reading a policy file: YAML text in, a `Policy` or one `PolicyError` listing every problem out.

Policy files come from repositories and pull requests, so the loader treats them as hostile: the
size, nesting and number of rules are bounded, anchors and aliases are refused (they are how a
small file expands into a huge tree), and nothing but plain scalars, lists and mappings is read.
It composes the YAML node tree instead of calling `safe_load` so that every problem can name the
line and column it comes from, and so that duplicate keys (which YAML silently collapses) are seen.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from ipaddress import ip_address, ip_network
from pathlib import Path

import yaml

from policy.model import MODES, PROTOCOLS, SUPPORTED_VERSION, Network, Policy, Rule
from policy.reserved import reserved_containing

MAX_BYTES = 256 * 1024
MAX_RULES = 256
MAX_PORTS_PER_RULE = 128
MAX_DEPTH = 16
MAX_PROBLEMS = 100

TOP_KEYS = ("version", "mode", "allow")
RULE_KEYS = ("host", "cidr", "ports", "protocol")
INT_TAG = "tag:yaml.org,2002:int"
STR_TAG = "tag:yaml.org,2002:str"
NULL_TAG = "tag:yaml.org,2002:null"
EXAMPLE = "'version: 1', 'mode: block' and an 'allow' list of entries like {host: pypi.org, ports: [443]}"

_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# libyaml when present: several times faster on large files, with the same marks.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DECIMAL = re.compile(r"-?(0|[1-9][0-9]{0,9})")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy file, at a 1-based line and column (0 when it is the whole file)."""

    file: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        if self.line <= 0:
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


class PolicyError(Exception):
    """Every problem found in one policy, in file order; `str()` prints them like a linter."""

    def __init__(self, problems: list[Problem]):
        self.problems = sorted(problems, key=lambda p: (p.file, p.line == 0, p.line, p.column))
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(str(problem) for problem in self.problems)


class _Problems:
    """Collects problems for one source, so the walk can keep going after the first one."""

    def __init__(self, source_name: str):
        self.source_name = source_name
        self.items: list[Problem] = []
        self.dropped = 0

    def add(self, mark: yaml.Mark | None, message: str) -> None:
        if len(self.items) >= MAX_PROBLEMS:
            self.dropped += 1
            return
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (0, 0)
        self.items.append(Problem(self.source_name, line, column, message))

    def at(self, node: yaml.Node, message: str) -> None:
        self.add(node.start_mark, message)


def load_policy(source: str | Path, source_name: str | None = None) -> Policy:
    """Load a policy from a file (`Path`) or from YAML text (`str`).

    `source_name` is what problems are reported against (defaults to the path, or `<policy>` for
    text). Raises `PolicyError` for anything wrong, including unreadable files; never anything else.
    """
    if isinstance(source, Path):
        name = source_name or str(source)
        text = _read_file(source, name)
    else:
        name = source_name or "<policy>"
        text = source
    problems = _Problems(name)
    policy = _parse_policy(text, problems)
    if problems.dropped:
        problems.items.append(Problem(name, 0, 0, f"{problems.dropped} more problems not shown; fix the ones above first"))
    if problems.items or policy is None:
        raise PolicyError(problems.items)
    return policy


def _read_file(path: Path, name: str) -> str:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        raise PolicyError([Problem(name, 0, 0, f"cannot read the policy: {exc.strerror or exc}")]) from None
    if len(data) > MAX_BYTES:
        raise PolicyError([Problem(name, 0, 0, f"the policy is larger than {MAX_BYTES} bytes; "
                                               "a policy needs a handful of rules, not a file this size")])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = _position(data[: exc.start].decode("utf-8", "replace"), exc.start)
        raise PolicyError([Problem(name, line, column, "the policy is not UTF-8 text; save it as UTF-8")]) from None


def _position(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of a character offset."""
    before = text[:index]
    return before.count("\n") + 1, index - (before.rfind("\n") + 1) + 1


def _parse_policy(text: str, problems: _Problems) -> Policy | None:
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate: text that no UTF-8 file can hold
        line, column = _position(text, exc.start)
        problems.items.append(Problem(problems.source_name, line, column,
                                      "the policy is not valid Unicode text; save it as UTF-8"))
        return None
    if size > MAX_BYTES:
        problems.add(None, f"the policy is larger than {MAX_BYTES} bytes; "
                           "a policy needs a handful of rules, not a text this size")
        return None
    node = _compose(text, problems)
    if problems.items:
        return None
    if node is None or _is_null(node):
        problems.add(yaml.Mark("", 0, 0, 0, None, None),
                     f"the policy is empty; write {EXAMPLE}")
        return None
    return _policy(node, problems)


def _compose(text: str, problems: _Problems) -> yaml.Node | None:
    """The node tree, after a streaming pass that refuses aliases and deep nesting (composing
    either would cost memory or recursion out of proportion to the file's size)."""
    try:
        depth = 0
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, yaml.AliasEvent):
                problems.add(event.start_mark, "YAML aliases (*name) are not allowed in a policy; "
                                               "write the entry out in full")
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    problems.add(event.start_mark, f"the policy is nested deeper than {MAX_DEPTH} levels; "
                                                   "a policy is a mapping with a list of flat entries")
                    return None
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        if problems.items:
            return None
        return yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        problems.add(mark, f"YAML syntax error: {what}; fix the YAML (indentation, quotes, colons)")
    except yaml.reader.ReaderError as exc:
        line, column = _position(text, exc.position)
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        problems.items.append(Problem(problems.source_name, line, column,
                                      f"the policy contains a character YAML does not allow "
                                      f"(U+{code:04X}); remove it"))
    except yaml.YAMLError as exc:
        problems.add(None, f"YAML error: {exc}")
    return None


def _mapping(node: yaml.MappingNode, known: tuple[str, ...], what: str,
             problems: _Problems) -> tuple[dict[str, yaml.Node], list[tuple[str, yaml.Node]]]:
    """A mapping's values by key, and the values of repeated keys (to be checked too, so that
    every problem is reported), reporting non-string, unknown and duplicate keys."""
    values: dict[str, yaml.Node] = {}
    first_lines: dict[str, int] = {}
    duplicates: list[tuple[str, yaml.Node]] = []
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != STR_TAG:
            problems.at(key_node, f"{what} keys must be plain names; known keys: {', '.join(known)}")
            continue
        key = key_node.value
        if key not in known:
            problems.at(key_node, _unknown_key(key, known, what))
        elif key in values:
            problems.at(key_node, f"duplicate key {_quote(key)} (first on line {first_lines[key]}); YAML "
                                  "would silently keep only the last one: merge them into one")
            duplicates.append((key, value_node))
        else:
            values[key] = value_node
            first_lines[key] = key_node.start_mark.line + 1
    return values, duplicates


def _unknown_key(key: str, known: tuple[str, ...], what: str) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"
    return f"unknown key {_quote(key)} in {what}; {hint}"


def _quote(value: str) -> str:
    """A value from the file, quoted and cut short: it is untrusted and ends up in logs."""
    return repr(value if len(value) <= 60 else value[:57] + "...")


def _kind(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return _quote(node.value)


def _policy(node: yaml.Node, problems: _Problems) -> Policy | None:
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"the policy must be a mapping with keys version, mode and allow, "
                          f"not {_kind(node)}; write {EXAMPLE}")
        return None
    values, duplicates = _mapping(node, TOP_KEYS, "the policy", problems)
    checks = {
        "version": lambda value: _version(value, node, problems),
        "mode": lambda value: _mode(value, problems),
        "allow": lambda value: _rules(value, problems),
    }
    for key, value in duplicates:
        checks[key](value)
    version, mode, rules = (checks[key](values.get(key)) for key in ("version", "mode", "allow"))
    if version is None or mode is None or rules is None:
        return None
    return Policy(version=version, mode=mode, rules=tuple(rules))


def _version(node: yaml.Node | None, top: yaml.Node, problems: _Problems) -> int | None:
    if node is None:
        problems.at(top, f"missing 'version'; add 'version: {SUPPORTED_VERSION}' at the top")
        return None
    value = _int(node)
    if value is None:
        problems.at(node, f"version: {_kind(node)} is not a version; use version: {SUPPORTED_VERSION} (a number)")
    elif value != SUPPORTED_VERSION:
        problems.at(node, f"version: {value} is not supported; this runner reads version {SUPPORTED_VERSION}")
        return None
    return value


def _mode(node: yaml.Node | None, problems: _Problems) -> str | None:
    if node is None:
        return "block"
    if isinstance(node, yaml.ScalarNode) and node.tag == STR_TAG and node.value in MODES:
        return node.value
    problems.at(node, f"mode: {_kind(node)} is not a mode; use block or audit")
    return None


def _rules(node: yaml.Node | None, problems: _Problems) -> list[Rule] | None:
    if node is None or _is_null(node):
        return []
    if not isinstance(node, yaml.SequenceNode):
        problems.at(node, "allow must be a list of entries such as '- host: pypi.org' with 'ports: [443]'")
        return None
    if len(node.value) > MAX_RULES:
        problems.at(node, f"allow has {len(node.value)} entries; at most {MAX_RULES} are allowed: "
                          "use wildcards or wider networks")
        return None
    rules = [_rule(item, problems) for item in node.value]
    return None if any(rule is None for rule in rules) else rules


def _rule(node: yaml.Node, problems: _Problems) -> Rule | None:
    if not isinstance(node, yaml.MappingNode):
        problems.at(node, f"an allow entry must be a mapping like {{host: pypi.org, ports: [443]}}, "
                          f"not {_kind(node)}")
        return None
    before = len(problems.items)
    values, duplicates = _mapping(node, RULE_KEYS, "an allow entry", problems)
    checks = {
        "host": lambda value: _host(value, problems),
        "cidr": lambda value: _cidr(value, problems),
        "ports": lambda value: _ports(value, node, problems),
        "protocol": lambda value: _protocol(value, problems),
    }
    for key, value in duplicates:
        checks[key](value)
    host = network = None
    if "host" in values and "cidr" in values:
        problems.at(node, "an allow entry has both 'host' and 'cidr'; split it into two entries")
    elif "host" in values:
        host = checks["host"](values["host"])
    elif "cidr" in values:
        network = checks["cidr"](values["cidr"])
    else:
        problems.at(node, "an allow entry needs 'host' (a DNS name) or 'cidr' (a network)")
    ports = checks["ports"](values.get("ports"))
    protocol = checks["protocol"](values.get("protocol"))
    if len(problems.items) != before or ports is None or (host is None and network is None):
        return None
    return Rule(ports=ports, protocol=protocol, host=host, network=network)


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == NULL_TAG


def _int(node: yaml.Node) -> int | None:
    """A plain decimal integer. YAML 1.1 would also read 0443 as octal 291, 0x1bb as hex and 7:23
    as base 60; a policy that means 443 should not silently become something else."""
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG and _DECIMAL.fullmatch(node.value):
        return int(node.value)
    return None


def _string(node: yaml.Node) -> str | None:
    if isinstance(node, yaml.ScalarNode) and node.tag == STR_TAG:
        return node.value
    return None


def _host(node: yaml.Node, problems: _Problems) -> str | None:
    value = _string(node)
    if value is None:
        problems.at(node, f"host: {_kind(node)} is not a host name; write a name such as pypi.org")
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
            return f"{_quote(value)} is a bad wildcard; only a leading '*.' label is allowed, like '*.example.org'"
        if base.count(".") < 1:
            return (f"{_quote(value)} would match a whole top-level domain; name a domain under it, "
                    "like '*.example.org' (or use cidr: 0.0.0.0/0 if you mean everything)")
        return _name_error(value, base)
    return _name_error(value, name)


def _name_error(value: str, name: str) -> str | None:
    try:
        ip_address(name)
        return f"{_quote(value)} is an IP address; use cidr: {value}/{32 if ':' not in name else 128} instead"
    except ValueError:
        pass
    if name.endswith("."):
        return f"{_quote(value)} ends with a dot; drop the trailing dot"
    if not name or len(name) > 253:
        return f"{_quote(value)} is not a DNS name (1..253 characters)"
    labels = name.split(".")
    for label in labels:
        if not _LABEL.fullmatch(label):
            return (f"{_quote(value)} has an invalid label {_quote(label)}; labels are 1..63 letters, digits "
                    "and inner hyphens")
    if labels[-1].isdigit():
        return f"{_quote(value)} ends in a numeric label, which no DNS name does; check for a typo"
    return None


def _cidr(node: yaml.Node, problems: _Problems) -> Network | None:
    value = _string(node)
    if value is None:
        problems.at(node, f"cidr: {_kind(node)} is not a network; write one like 10.20.0.0/16 (in quotes if needed)")
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
        return f"{_quote(value)} has host bits set; did you mean {ip_network(value, strict=False)}?"
    except ValueError:
        return f"{_quote(value)} is not a network; write one like 10.20.0.0/16 or 2001:db8::/32"


def _ports(node: yaml.Node | None, rule: yaml.Node, problems: _Problems) -> frozenset[int] | None:
    if node is None:
        problems.at(rule, "an allow entry needs 'ports', e.g. ports: [443]")
        return None
    if not isinstance(node, yaml.SequenceNode):
        hint = f"ports: [{node.value}]" if _int(node) is not None else "ports: [443]"
        problems.at(node, f"ports must be a list; write {hint}")
        return None
    if not node.value:
        problems.at(node, "ports is empty; list at least one port, e.g. [443]")
        return None
    if len(node.value) > MAX_PORTS_PER_RULE:
        problems.at(node, f"ports lists {len(node.value)} ports; at most {MAX_PORTS_PER_RULE} per entry")
        return None
    ports = [_port(item, problems) for item in node.value]
    return None if any(port is None for port in ports) else frozenset(ports)


def _port(node: yaml.Node, problems: _Problems) -> int | None:
    value = _int(node)
    if value is None:
        problems.at(node, f"ports: {_kind(node)} is not a port number (a decimal integer 1..65535){_port_hint(node)}")
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


def _protocol(node: yaml.Node | None, problems: _Problems) -> str:
    if node is None:
        return "tcp"
    value = _string(node)
    if value not in PROTOCOLS:
        problems.at(node, f"protocol: {_kind(node)} is not supported; use tcp or udp")
        return "tcp"
    return value
