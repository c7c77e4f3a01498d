"""Reading the service's YAML configuration into its settings (settings.py), in one pass guided by the
dataclasses' fields.

The file is read through `policy.yamldoc`, as the policy loader does: bounded size and depth, no
aliases, UTF-8 only, duplicate keys refused. A service that refuses to start must say exactly what to
fix, so every problem of the file is reported at once, each with its file:line:col and the key, and
values quoted back are cut short. Numbers must be finite and within their range: `.inf` or `.nan`
seconds would make timers that never fire or raise. What spans several settings is checked after the
walk (checks.py), at the line of the setting it names.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, Field, fields
from fractions import Fraction
from ipaddress import ip_network
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from policy.model import Network as IpNetwork
from policy.model import Rule, is_protocol
from policy.render import OperatorAllowances
from policy.yamldoc import (
    BOOL_TAG,
    FLOAT_TAG,
    INT_TAG,
    STR_TAG,
    DocumentLimits,
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
from runner.jobapi.contract import REPOSITORY  # the job API's contract: the one repository pattern
from runner.service.config.checks import check_config, check_webhook
from runner.service.config.settings import (
    GIB,
    KIB,
    MAX_ALLOW_RULES,
    MAX_LIST,
    MAX_STRING,
    MIB,
    SIZE_NAME_PATTERN,
    SIZE_PATTERN,
    TIB,
    ServiceConfig,
    SettingMeta,
    SizeClass,
    WebhookSettings,
    setting_meta,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LIMITS = DocumentLimits("config", 64 * 1024, 8, "a config is a mapping of settings with a few small sections",
                max_problems=20)
_SIZE = re.compile(SIZE_PATTERN)
_UNITS = {"": 1, "B": 1, "K": KIB, "M": MIB, "G": GIB, "T": TIB}
_INTEGER = re.compile(r"[-+]?[0-9]{1,19}")
_NON_FINITE = re.compile(r"[-+]?\.(inf|Inf|INF|nan|NaN|NAN)")
# The repository names jobs and sandboxes run as are the contract's (what a submit or a create is checked
# against).
REPOSITORY_RULE = ("write owner/name: each part 1 to 100 letters, digits, '_', '.' or '-', and neither part "
                   "'.' nor '..' (e.g. my-org/my-repo)")
# A list item's own reading: a plain string.
_ITEM = SettingMeta(kind="string", help="", minimum=None, maximum=None, pattern=None, section=None)
T = TypeVar("T", bound="DataclassInstance")


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
    walk = Walk(problems, base)
    node = _to_node(data, problems)
    settings = walk.section(WebhookSettings, node, "webhook.") if not problems.items else None
    if settings is not None:
        check_webhook(settings, walk, "webhook.")
    if problems.items or settings is None:
        raise ConfigError(sort_problems(problems.final()))
    return settings


def _build(node: yaml.Node | None, problems: Problems, base: Path) -> ServiceConfig:
    walk = Walk(problems, base)
    config = walk.section(ServiceConfig, node, "") if not problems.items else None
    if config is not None:
        config = check_config(config, walk)
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


class Walk:
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
        meta = setting_meta(f)
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


def _default(f: Field[object]) -> object:
    """A setting's default: its value, or a fresh one from its factory (`setting` gives it one of the two)."""
    if f.default is not MISSING:
        return f.default
    assert callable(f.default_factory), f"setting {f.name} has no default"
    return f.default_factory()
