"""A model of how actions/runner turns a step's output into workflow commands.

Written from actions/runner's source (src/Runner.Common/ActionCommand.cs `TryParseV2`/`TryParse`,
src/Runner.Worker/ActionCommandManager.cs `TryProcessCommand`, src/Runner.Sdk/ProcessInvoker.cs
reading lines with .NET `StreamReader.ReadLine`), independently of action/workflow.py, so the tests
check our output against what the runner would do rather than against our own assumptions.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from dataclasses import dataclass, field

# .NET char.IsWhiteSpace: Zs, Zl, Zp, U+0009-U+000D, U+0085.
DOTNET_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(chr(c) for c in range(0x2000, 0x200B))
    + "\u2028\u2029\u202f\u205f\u3000"
)
REGISTERED = {
    "set-output", "set-env", "add-path", "add-mask", "echo", "debug", "warning", "error", "notice",
    "group", "endgroup", "save-state", "add-matcher", "remove-matcher", "stop-commands",
}


# .NET's `StartsWith(string)` and `IndexOf(string)` are culture-sensitive; with ICU (the runner on
# Linux) "completely ignorable" code points (format characters such as U+200B, C0/C1 controls) are
# skipped while matching, but Substring offsets stay ordinal. The model can compare either way.
ICU_IGNORABLE = frozenset(
    chr(c) for c in range(sys.maxunicode + 1)
    if (unicodedata.category(chr(c)) in ("Cf", "Cc") and chr(c) not in "\t\n\x0b\x0c\r\x85")
)


def _find(text: str, pattern: str, start: int, ignorable: frozenset[str], include_leading: bool) -> int:
    """IndexOf: ordinal when `ignorable` is empty, else ICU-like, skipping ignorable characters."""
    if not ignorable:
        return text.find(pattern, start)
    for i in range(start, len(text)):
        if text[i] in ignorable and not include_leading:
            continue
        j, k = i, 0
        while k < len(pattern) and j < len(text):
            if text[j] in ignorable:
                j += 1
            elif text[j] == pattern[k]:
                j, k = j + 1, k + 1
            else:
                break
        if k == len(pattern):
            return i
    return -1


def _starts_with(text: str, pattern: str, ignorable: frozenset[str]) -> bool:
    """StartsWith: ordinal when `ignorable` is empty, else ICU-like."""
    i = k = 0
    while k < len(pattern) and i < len(text):
        if text[i] in ignorable:
            i += 1
        elif text[i] == pattern[k]:
            i, k = i + 1, k + 1
        else:
            return False
    return k == len(pattern)


def read_lines(text: str) -> list[str]:
    """StreamReader.ReadLine: lines end at \\r\\n, \\r or \\n; a final partial line counts."""
    lines = re.split(r"\r\n|\r|\n", text)
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def parse_v2(line: str, registered: set[str], ignorable: frozenset[str] = frozenset(),
             include_leading: bool = False) -> tuple[str, str] | None:
    message = line.lstrip(DOTNET_WHITESPACE)
    if not _starts_with(message, "::", ignorable):
        return None
    end = _find(message, "::", 2, ignorable, include_leading)
    if end < 0:
        return None
    name = message[2:end].split(" ", 1)[0]
    if name.lower() not in registered:
        return None
    return name.lower(), message[end + 2 :]


def parse_v1(line: str, registered: set[str], ignorable: frozenset[str] = frozenset(),
             include_leading: bool = False) -> tuple[str, str] | None:
    start = _find(line, "##[", 0, ignorable, include_leading)
    if start < 0:
        return None
    end = line.find("]", start)
    if end < 0:
        return None
    name = line[start + 3 : end].split(" ", 1)[0]
    if name.lower() not in registered:
        return None
    return name.lower(), line[end + 1 :]


@dataclass
class RunnerModel:
    """Feeds lines through the runner's command state machine and records what it executed."""

    ignorable: frozenset[str] = frozenset()  # ICU_IGNORABLE to compare like ICU
    include_leading: bool = False  # whether an ICU match may start at leading ignorables
    registered: set[str] = field(default_factory=lambda: set(REGISTERED))
    stopped_with: str | None = None
    executed: list[tuple[str, str]] = field(default_factory=list)

    def feed(self, text: str) -> None:
        for line in read_lines(text):
            self.line(line)

    def line(self, line: str) -> None:
        parsed = (parse_v2(line, self.registered, self.ignorable, self.include_leading)
                  or parse_v1(line, self.registered, self.ignorable, self.include_leading))
        if parsed is None:
            return
        name, data = parsed
        if self.stopped_with is not None:
            if name == self.stopped_with.lower():
                self.registered.discard(self.stopped_with.lower())
                self.stopped_with = None
                self.executed.append(("resume", name))
            return
        if name == "stop-commands":
            self.stopped_with = data
            self.registered.add(data.lower())
        self.executed.append((name, data))
