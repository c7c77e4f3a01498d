"""GitHub Actions workflow commands and files, written so that untrusted text cannot forge them.

The runner (actions/runner, `ActionCommandManager` + `ActionCommand.TryParseV2/TryParse`) reads a step's
stdout *and* stderr with .NET `StreamReader.ReadLine`, which ends a line at `\\n`, `\\r` or `\\r\\n`, and
treats a line as a command when either
  - the line, after .NET `TrimStart()` (Unicode white space), starts with `::`, or
  - the line contains `##[` anywhere (the legacy form).
Command names are matched case-insensitively. So any text that came from the guest must be split the
way the runner splits it, and every resulting line must fail both tests. We do that by prefixing a
ZERO WIDTH SPACE (U+200B, not white space for .NET, so `TrimStart` keeps it) to lines that would start
with `::`, and by breaking every `##[` into `##\\u200b[`. The text stays readable; only an invisible
character is added.

`StartsWith`/`IndexOf(string)` are culture-sensitive in .NET, and with ICU (the runner on Linux) they
skip ignorable characters such as U+200B, so `"\\u200b::x".StartsWith("::")` can be true. That is still
safe because the runner then cuts the command name at fixed *ordinal* offsets (2 after `::`, 3 after
`##[`): with a character inserted inside or before the marker, the cut starts at `:`, `[` or the
inserted character, and no registered command name starts with those. C0 controls (also ignorable)
are replaced outright. tests/action/gha_runner_model.py checks this with ordinal and ICU-like models.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

ZWSP = "\u200b"
# .NET ReadLine line ends; Python's str.splitlines would also split on \x0b, \x0c, \x1c-\x1e, \x85,
# \u2028, \u2029, which the runner does not, so we split exactly like the runner.
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
# C0 controls except TAB and ESC (colours are fine): NUL and friends only confuse log viewers.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1a\x1c-\x1f\x7f]")


def split_lines(text: str) -> list[str]:
    """Split text where the runner would: at \\r\\n, \\r and \\n."""
    return _LINE_BREAK.split(text)


def neutralise_line(line: str) -> str:
    """Make one line (already free of line breaks) inert for the runner's command parser."""
    line = _CONTROL.sub("\ufffd", line)
    line = line.replace("##[", f"##{ZWSP}[")
    # Python's str.isspace is a superset of .NET's char.IsWhiteSpace, so lstrip removes at least
    # everything TrimStart would: a line that TrimStart turns into "::..." is always caught.
    if line.lstrip().startswith("::"):
        line = ZWSP + line
    return line


def safe_text(text: str) -> str:
    """Untrusted text of any length, as lines that print without triggering a command."""
    return "\n".join(neutralise_line(line) for line in split_lines(text))


def escape_data(value: str) -> str:
    """The runner's data escaping (`ActionCommand._escapeDataMappings`), `%` first."""
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(value: str) -> str:
    """The runner's property escaping (`_escapePropertyMappings`), `%` first."""
    return escape_data(value).replace(":", "%3A").replace(",", "%2C")


def command(name: str, message: str = "", **properties: str | int | None) -> str:
    """One workflow command line; properties with a None value are left out."""
    props = ",".join(
        f"{key}={escape_property(str(value))}" for key, value in properties.items() if value is not None
    )
    head = f"{name} {props}" if props else name
    return f"::{head}::{escape_data(message)}"


def annotation(level: str, message: str, *, file: str | None = None, line: int | None = None,
               title: str | None = None) -> str:
    """An `::error`/`::warning`/`::notice` annotation line."""
    if level not in ("error", "warning", "notice"):
        raise ValueError(f"unknown annotation level {level!r}")
    return command(level, message, file=file, line=line, title=title)


def stop_token() -> str:
    """A resume token the guest cannot guess: 128 random bits."""
    return "mvc" + secrets.token_hex(16)


def _delimiter(value: str) -> str:
    while True:
        delim = f"ghadelimiter_{secrets.token_hex(16)}"
        if delim not in value:
            return delim


def format_outputs(outputs: Mapping[str, str]) -> str:
    """Step outputs in the `$GITHUB_OUTPUT` multi-line syntax, with a random delimiter per value.

    The delimiter is random so that a value (which may hold guest-derived text such as the job record)
    can never end its own block early and start a forged `name=value` line.
    """
    chunks = []
    for name, value in outputs.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", name):
            raise ValueError(f"invalid output name {name!r}")
        delim = _delimiter(value)
        chunks.append(f"{name}<<{delim}\n{value}\n{delim}\n")
    return "".join(chunks)


def append_file(env_name: str, text: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Append to a runner file named by an env var (`GITHUB_OUTPUT`, `GITHUB_STEP_SUMMARY`).

    Returns False when the variable is unset, so the action also works outside Actions.
    """
    path = environ.get(env_name)
    if not path:
        return False
    with Path(path).open("a", encoding="utf-8") as handle:
        handle.write(text)
    return True
