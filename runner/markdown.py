"""Guest-derived text made inert: the step summary (action/summary.py) and the pull request's check run
(runner/github/checks.py) render it as GitHub-flavoured Markdown, and the check run's annotations show it
as plain text, so all of them neutralise it here, one way (`inert`), and the Markdown ones escape it too
(`cell`). A leaf module: it imports nothing of the project.

What a guest could do with raw text, and what stops it:
- control characters (NUL, ESC, ...), format characters (U+202E and the other bidi overrides, zero-width
  ones) and unassigned or private code points: each becomes U+FFFD, so nothing reorders or hides text,
  no terminal escape survives, and GitHub never refuses a body for a NUL (`inert`, everywhere);
- `@name` would mention (and notify) a GitHub user or team, `#12` and `owner/repo#12` would link an issue
  (and put a reference in its timeline), `name@example.org` and `mailto:`/`xmpp:` would become links: a
  zero-width space after every `@` and `#` leaves the text as it reads and matches none of them
  (`inert`, everywhere: GitHub finds mentions in the rendered text);
- in Markdown (`cell`): `https://...` and `www.` autolinks get a zero-width space inside `://` and
  `www.`; HTML, links, images, code spans, extra table columns and backslash escapes get the characters
  that start them written as HTML entities, which a renderer decodes only after it parsed the markup.
Entities alone stop no autolink and no mention: cmark-gfm decodes `&#64;` before it finds e-mail
addresses, and GitHub finds mentions after rendering; hence the zero-width spaces, which work as
characters wherever the text goes.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator

MAX_CELL = 200
BREAK = "\u200b"  # zero width space: ends a mention, a reference or an autolink without changing the text's look
REPLACEMENT = "\ufffd"
ELLIPSIS = "…"
# What a code span may show as it is: CommonMark decodes no entity inside a code span (spec 6.1), so an
# escaped value there would read `sha256&#58;...`; a value that needs escaping is a plain cell instead.
_CODE_SAFE = re.compile(r"[A-Za-z0-9._:/+=-]{1,200}")
# One step of the walk over guest text: the sequences that need a break, or one character.
_STEP = re.compile(r"www\.|://|.", re.IGNORECASE | re.DOTALL)
_MENTIONS = {"@": "@" + BREAK, "#": "#" + BREAK}
# Markdown and HTML that a cell must not start: tags and entities, table columns, code spans, links and
# images, backslash escapes. `:` too: cmark-gfm's URL autolinks start at a literal `:`.
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;", "|": "&#124;", "`": "&#96;",
             "[": "&#91;", "]": "&#93;", "\\": "&#92;", "!": "&#33;", ":": "&#58;"}


def inert(value: object, limit: int, keep: str = "") -> str:
    """Guest text with nothing in it that acts (see the module's docstring), at most `limit` characters
    (an ellipsis ends it when cut). `keep` names control characters that stay (an annotation keeps its
    newlines and tabs). For plain text: GitHub shows annotations as they are."""
    return _bounded(_inert_pieces(str(value), keep, links=False), limit)


def cell(value: object, limit: int = MAX_CELL) -> str:
    """A value safe inside a Markdown table cell, a heading or a quote: `inert`, on one line (runs of
    white space become one space), with Markdown's and HTML's characters as entities; at most `limit`
    characters of Markdown."""
    flat = " ".join(str(value).split())
    pieces = _inert_pieces(flat, "", links=True)
    return _bounded(("".join(_ENTITIES.get(c, c) for c in piece) for piece in pieces), limit)


def code(value: object) -> str:
    """A value as a code span inside a table cell when it needs no escaping (digests, ids), else `cell`."""
    text = str(value)
    return f"`{text}`" if _CODE_SAFE.fullmatch(text) else cell(text)


def fence(lines: list[str], info: str = "") -> list[str]:
    """`lines` as a fenced code block whose fence no line can close early: longer than any run of
    backticks in them (CommonMark closes a block only with a fence at least as long as the opening)."""
    longest = max((len(run) for line in lines for run in re.findall(r"`+", line)), default=0)
    marker = "`" * max(3, longest + 1)
    return [marker + info, *lines, marker]


def _inert_pieces(text: str, keep: str, links: bool) -> Iterator[str]:
    """`text` in pieces that do nothing, each a character or a sequence with its break; with `links`,
    also broken where a Markdown autolink would start."""
    for match in _STEP.finditer(text):
        step = match.group()
        if len(step) > 1:  # `www.` in any case, or `://`
            yield (step[:-1] + BREAK + step[-1] if len(step) == 4 else ":" + BREAK + "//") if links else step
        elif step in _MENTIONS:
            yield _MENTIONS[step]
        elif step in keep or not _acts(step):
            yield step
        else:
            yield REPLACEMENT


def _acts(char: str) -> bool:
    """Whether a character does something other than show: a control or format character (bidi
    overrides, zero-width ones), a surrogate, a private-use or unassigned code point, a line or
    paragraph separator."""
    return unicodedata.category(char)[0] == "C" or char in "\u2028\u2029"


def _bounded(pieces: Iterable[str], limit: int) -> str:
    """The pieces joined, at most `limit` characters: when they do not fit, as many whole pieces as fit
    and the ellipsis (a piece is never split, so no entity or break is cut in half). Reads no further
    than the first piece past the limit: a guest's long text costs no more than a short one."""
    kept: list[str] = []
    size = 0
    for piece in pieces:
        kept.append(piece)
        size += len(piece)
        if size > limit:
            while kept and size + len(ELLIPSIS) > limit:
                size -= len(kept.pop())
            return "".join(kept) + ELLIPSIS
    return "".join(kept)
