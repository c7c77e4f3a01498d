"""JSON request bodies from outside: UTF-8, nesting (and, for strangers' bodies, the count of arrays and
objects) bounded before parsing, no lone surrogates after.

json.loads recurses once per level: a 2 KB body nested 1,000 deep raises RecursionError, and
anything that later walks a deep value (json.dumps into a record) may too. An escaped lone
surrogate ("\\ud800") parses into a str that cannot be encoded to UTF-8, so it would fail later, in
SQLite or a log line, as a 500. Both are refused here, as the caller's 400.

json.loads, like the scan before it, holds the interpreter lock from start to end, and each array
or object it makes is one more for the garbage collector to walk: 1 MiB of `[],` (350,000 lists)
held it ~80 ms per body, and every other thread of the service (the connection loop, health) waited
behind (issue 40, item 9). `max_containers` refuses such a body after one cheap count.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from runner.errors import JobError

MAX_DEPTH = 64
MAX_CONTAINERS = 10_000  # arrays and objects in a job API body: a JobSpec, a sandbox call or JobStarted hold tens
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonBodyError(JobError):
    """The body is not JSON this service accepts; the message says why."""


def loads(data: bytes, max_depth: int = MAX_DEPTH, max_containers: int | None = None) -> Any:
    """The parsed body, or JsonBodyError saying why not. `max_containers` is for bodies a stranger sends (the
    job API's); the webhook's are GitHub's, signed, and a large push holds thousands of objects."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonBodyError(f"not UTF-8 (byte {exc.start})") from None
    structure = _STRING.sub("", text)  # what is outside strings
    if max_containers is not None and structure.count("[") + structure.count("{") > max_containers:
        raise JsonBodyError(f"more than {max_containers} arrays and objects")
    if _nesting(structure) > max_depth:
        raise JsonBodyError(f"nested deeper than {max_depth} levels")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise JsonBodyError(str(exc)) from None
    if _ESCAPED_SURROGATE.search(text) and _has_lone_surrogate(value):
        raise JsonBodyError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode text")
    return value


def _nesting(structure: str) -> int:
    """The deepest bracket nesting of text without its strings: a regex pass and a C-speed running sum, no
    recursion."""
    brackets = _NOT_BRACKET.sub("", structure)
    return max(accumulate(map(_STEP.__getitem__, brackets), initial=0))


def _has_lone_surrogate(value: Any) -> bool:
    """json.loads joins valid surrogate pairs, so any surrogate left in a string is a lone one."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
