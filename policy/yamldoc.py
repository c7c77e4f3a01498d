"""Reading a small, possibly hostile YAML document into a node tree whose every problem has a line.

Shared by the policy loader (files from pull requests) and the service and GitHub config loaders
(files an operator wrote by hand, but also what `config check` is pointed at). Both need the same
guarantees: the size and nesting are bounded and anchors/aliases are refused before anything is
built (aliases are how a 500-byte file expands into gigabytes: "billion laughs"), text must be
UTF-8, duplicate keys (which YAML silently collapses) are seen, values quoted back in messages are
cut short, and every problem carries its line and column so all of them can be reported at once.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import yaml

INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"
BOOL_TAG = "tag:yaml.org,2002:bool"
STR_TAG = "tag:yaml.org,2002:str"
NULL_TAG = "tag:yaml.org,2002:null"

# libyaml when present: several times faster on large files, with the same marks.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DECIMAL = re.compile(r"-?(0|[1-9][0-9]{0,9})")
_T = TypeVar("_T")


class Mark(Protocol):
    """Where in the text a node or event starts (0-based): PyYAML's own marks and libyaml's both have it."""

    line: int
    column: int


@dataclass(frozen=True)
class DocumentLimits:
    """What one kind of document may be, and the words its messages use for it."""

    noun: str  # "policy", "config": in "the policy is larger than ..."
    max_bytes: int
    max_depth: int
    shape: str  # says what the document should look like, after "nested deeper than N levels; "
    max_problems: int = 100
    # Refused before a node is built: composing costs ~20 us a node, so a 250 KB document of 50,000 lines
    # or one flow mapping of 40,000 keys took 1-2 s of the service's CPU just to be told it is too big.
    max_lines: int = 8192
    max_keys: int = 4096  # mapping keys in the whole document
    max_items: int = 1024  # entries of one list or mapping, block or flow


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a document, at a 1-based line and column (0 when it is the whole file)."""

    file: str
    line: int
    column: int
    message: str

    def __str__(self) -> str:
        if self.line <= 0:
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


def sort_problems(problems: list[Problem]) -> list[Problem]:
    """File order; whole-file problems after the located ones of the same file."""
    return sorted(problems, key=lambda p: (p.file, p.line == 0, p.line, p.column))


class Problems:
    """Collects problems for one source, so a walk can keep going after the first one."""

    def __init__(self, source_name: str, max_problems: int = 100):
        self.source_name = source_name
        self.max_problems = max_problems
        self.items: list[Problem] = []
        self.dropped = 0

    def add(self, mark: Mark | None, message: str) -> None:
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (0, 0)
        self.add_at(line, column, message)

    def add_at(self, line: int, column: int, message: str) -> None:
        if len(self.items) >= self.max_problems:
            self.dropped += 1
            return
        self.items.append(Problem(self.source_name, line, column, message))

    def at(self, node: yaml.Node, message: str) -> None:
        self.add(node.start_mark, message)

    def final(self) -> list[Problem]:
        """The problems, with a note when some were left out."""
        if not self.dropped:
            return list(self.items)
        return [*self.items, Problem(self.source_name, 0, 0,
                                     f"{self.dropped} more problems not shown; fix the ones above first")]


def read_text(path: Path, limits: DocumentLimits, problems: Problems) -> str | None:
    """The file's text, or None with a problem: unreadable, too large, or not UTF-8."""
    try:
        with path.open("rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        problems.add_at(0, 0, f"cannot read the {limits.noun}: {getattr(exc, 'strerror', None) or exc}")
        return None
    if len(data) > limits.max_bytes:
        problems.add_at(0, 0, f"the {limits.noun} is larger than {limits.max_bytes} bytes; "
                              f"a {limits.noun} needs a handful of {_entries(limits)}, not a file this size")
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = position(data[: exc.start].decode("utf-8", "replace"), exc.start)
        problems.add_at(line, column, f"the {limits.noun} is not UTF-8 text; save it as UTF-8")
        return None


def _entries(limits: DocumentLimits) -> str:
    return "rules" if limits.noun == "policy" else "settings"


def position(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of a character offset."""
    before = text[:index]
    return before.count("\n") + 1, index - (before.rfind("\n") + 1) + 1


def compose(text: str, limits: DocumentLimits, problems: Problems) -> yaml.Node | None:
    """The node tree of `text`, or None with problems. A streaming pass first refuses aliases and
    deep nesting (composing either would cost memory or recursion out of proportion to the size)."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate: text that no UTF-8 file can hold
        line, column = position(text, exc.start)
        problems.add_at(line, column, f"the {limits.noun} is not valid Unicode text; save it as UTF-8")
        return None
    if size > limits.max_bytes:
        problems.add(None, f"the {limits.noun} is larger than {limits.max_bytes} bytes; "
                           f"a {limits.noun} needs a handful of {_entries(limits)}, not a text this size")
        return None
    lines = text.count("\n") + (not text.endswith("\n"))
    if lines > limits.max_lines:
        problems.add(None, f"the {limits.noun} has {lines} lines, more than {limits.max_lines}; "
                           f"a {limits.noun} needs a handful of {_entries(limits)}, not a text this long")
        return None
    before = len(problems.items)
    aliases = 0
    try:
        depth = 0
        open_counts: list[int] = []  # nodes in each open collection (a mapping's keys and values both)
        open_mapping: list[bool] = []
        keys = 0
        for event in yaml.parse(text, Loader=_LOADER):
            if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)) \
                    and open_counts:
                open_counts[-1] += 1
                entries = (open_counts[-1] + 1) // 2 if open_mapping[-1] else open_counts[-1]
                if open_mapping[-1] and open_counts[-1] % 2 == 1:
                    keys += 1
                if entries > limits.max_items or keys > limits.max_keys:
                    problems.add(event.start_mark, _too_many(limits, keys > limits.max_keys))
                    return None
            if isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases == 1:
                    problems.add(event.start_mark, f"YAML aliases (*name) are not allowed in a {limits.noun}; "
                                                   "write the entry out in full")
            elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                open_counts.append(0)
                open_mapping.append(isinstance(event, yaml.MappingStartEvent))
                if depth > limits.max_depth:
                    problems.add(event.start_mark, f"the {limits.noun} is nested deeper than "
                                                   f"{limits.max_depth} levels; {limits.shape}")
                    return None
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
                open_counts.pop()
                open_mapping.pop()
        if aliases > 1:  # one problem for them all: a billion-laughs file has hundreds
            problems.items[before] = _more(problems.items[before], f"{aliases - 1} more aliases after it")
        if len(problems.items) != before:
            return None
        return yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        problems.add(mark, f"YAML syntax error: {what}; fix the YAML (indentation, quotes, colons)")
    except yaml.reader.ReaderError as exc:
        line, column = position(text, exc.position)
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        problems.add_at(line, column, f"the {limits.noun} contains a character YAML does not allow "
                                      f"(U+{code:04X}); remove it")
    except yaml.YAMLError as exc:
        problems.add(None, f"YAML error: {quote(str(exc), 200)}")
    return None


def _too_many(limits: DocumentLimits, keys: bool) -> str:
    if keys:
        return (f"the {limits.noun} has more than {limits.max_keys} keys in all; "
                f"a {limits.noun} needs a handful of {_entries(limits)}")
    return f"a list or mapping of the {limits.noun} has more than {limits.max_items} entries; {limits.shape}"


def _more(problem: Problem, note: str) -> Problem:
    return Problem(problem.file, problem.line, problem.column, f"{problem.message} ({note})")


def mapping(node: yaml.MappingNode, known: tuple[str, ...], what: str, problems: Problems,
            unknown: str = "unknown key {key} in {what}; {hint}") -> tuple[dict[str, yaml.Node], list[tuple[str, yaml.Node]]]:
    """A mapping's values by key, and the values of repeated keys (to be checked too, so that
    every problem is reported), reporting non-string, unknown and duplicate keys. `unknown` words
    the unknown-key message from `key` (quoted and shortened), `name` (the same without quotes),
    `what` and `hint` (a close match or the known keys)."""
    values: dict[str, yaml.Node] = {}
    first_lines: dict[str, int] = {}
    duplicates: list[tuple[str, yaml.Node]] = []
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != STR_TAG:
            problems.at(key_node, f"{what} keys must be plain names; known keys: {', '.join(known)}")
            continue
        key = key_node.value
        if key not in known:
            problems.at(key_node, unknown.format(key=quote(key), name=quote(key)[1:-1], what=what,
                                                 hint=_hint(key, known)))
        elif key in values:
            problems.at(key_node, f"duplicate key {quote(key)} (first on line {first_lines[key]}); YAML "
                                  "would silently keep only the last one: merge them into one")
            duplicates.append((key, value_node))
        else:
            values[key] = value_node
            first_lines[key] = key_node.start_mark.line + 1 if key_node.start_mark else 0
    return values, duplicates


def _hint(key: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(known)}"


def quote(value: str, limit: int = 60) -> str:
    """A value from the file, quoted and cut short: it is untrusted and ends up in logs."""
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")


def kind(node: yaml.Node) -> str:
    """How a node is named in a message: its shape, or its (shortened) text."""
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return quote(node.value)


def is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == NULL_TAG


def decimal_int(node: yaml.Node) -> int | None:
    """A plain decimal integer of at most 10 digits. YAML 1.1 would also read 0443 as octal 291,
    0x1bb as hex and 7:23 as base 60; a file that means 443 should not silently become something else."""
    if isinstance(node, yaml.ScalarNode) and node.tag == INT_TAG and _DECIMAL.fullmatch(node.value):
        return int(node.value)
    return None


def string(node: yaml.Node) -> str | None:
    if isinstance(node, yaml.ScalarNode) and node.tag == STR_TAG:
        assert isinstance(node.value, str)  # a scalar's value is its text (the stubs leave it untyped)
        return node.value
    return None


def all_or_none(items: list[_T | None]) -> list[_T] | None:
    """`items` when none is None (each was read without a problem), else None."""
    present = [item for item in items if item is not None]
    return present if len(present) == len(items) else None
