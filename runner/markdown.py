"""Guest-derived text made inert for GitHub-flavoured Markdown: the step summary (action/summary.py) and
the pull request's check run (runner/github/checks.py) both render it, so both escape it here, one way.
A leaf module: it imports nothing of the project.
"""

from __future__ import annotations

import html
import re

MAX_CELL = 200
# What a code span may show as it is: CommonMark decodes no entity inside a code span (spec 6.1), so an
# escaped value there would read `sha256&#58;...`; a value that needs escaping is a plain cell instead.
_CODE_SAFE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,200}")


def cell(value: object, limit: int = MAX_CELL) -> str:
    """A value safe inside a Markdown table cell: HTML-escaped, no pipes, backticks or newlines."""
    text = str(value)
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    text = html.escape(text, quote=True)
    # No links, images, code spans or extra columns; `:` and `www.` so that GFM makes no autolinks.
    for char, repl in (("|", "&#124;"), ("`", "&#96;"), ("[", "&#91;"), ("]", "&#93;"),
                       ("\\", "&#92;"), ("!", "&#33;"), (":", "&#58;"), ("www.", "www&#46;")):
        text = text.replace(char, repl)
    return " ".join(text.split())


def code(value: object) -> str:
    """A value as a code span inside a table cell when it needs no escaping (digests, ids), else `cell`."""
    text = str(value)
    return f"`{text}`" if _CODE_SAFE.fullmatch(text) else cell(text)
