"""Markdown rendered as GitHub renders it, and what in the result would act on a reader.

`render` is cmark-gfm itself (the cmarkgfm package bundles GitHub's C library) with GitHub's extensions
(tables, autolinks, strikethrough, tag filter) and raw HTML let through, as GitHub lets it through to
its sanitiser: whatever tag guest text could open shows here. `acting` lists what guest text must never
produce on a pull request's page: a link or an image, any tag but the ones the summaries are built of, an
`@mention` or an issue reference (GitHub finds those in the rendered text: `@` or `#` right before a
letter or digit), and control or format characters (NUL, ESC, bidi overrides), the zero-width space
`runner.markdown` puts in itself excepted.
"""

from __future__ import annotations

import re
import unicodedata

import cmarkgfm
from cmarkgfm import Options

# The tags a summary's own Markdown renders to: paragraphs, headings, tables, code, bold, quotes.
OWN_TAGS = {"p", "h3", "h4", "table", "thead", "tbody", "tr", "th", "td", "code", "pre", "strong", "blockquote"}
BREAK = "\u200b"  # the zero-width space runner.markdown puts after `@` and `#` and inside `://`
_TAG = re.compile(r"</?([A-Za-z][A-Za-z0-9-]*)")
_MENTION_OR_REFERENCE = re.compile(r"[@#][A-Za-z0-9]")


def render(markdown: str) -> str:
    return cmarkgfm.github_flavored_markdown_to_html(markdown, options=Options.CMARK_OPT_UNSAFE)


def acting(html: str) -> list[str]:
    """What in `html` would act on a reader; empty when nothing does."""
    found = [f"<{tag}>" for tag in sorted({t.lower() for t in _TAG.findall(html)} - OWN_TAGS)]
    found += [f"mention or reference {m!r}" for m in sorted(set(_MENTION_OR_REFERENCE.findall(html)))]
    found += [f"U+{ord(c):04X}" for c in sorted(set(html)) if c != "\n" and c != BREAK
              and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")]
    return found
