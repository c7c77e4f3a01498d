"""The terminal filter (runner/service/api/termfilter.py): a guest's output may draw on the operator's
terminal and do nothing else, however it splits its sequences across chunks (issue 37)."""

from __future__ import annotations

import pytest

from runner.service.api.termfilter import MAX_STRING, TerminalFilter

ACTING = {
    "OSC 52 clipboard write (BEL)": b"\x1b]52;c;ZWNobyBwd25lZA==\x07",
    "OSC 52 clipboard write (ST)": b"\x1b]52;c;ZWNobyBwd25lZA==\x1b\\",
    "title set and OSC colour query": b"\x1b]0;title\x07\x1b]11;?\x07",
    "OSC 8 hyperlink": b"\x1b]8;;https://evil.example\x1b\\",
    "OSC 50 font": b"\x1b]50;evil-font\x07",
    "DSR cursor position report": b"\x1b[6n",
    "DA device attributes": b"\x1b[c\x1b[>c\x1b[=c",
    "window title report": b"\x1b[21t\x1b[14t",
    "DECRQM mode report": b"\x1b[?2004$p",
    "DECRQSS status string": b"\x1bP$q\"p\x1b\\",
    "DECUDK key remapping": b"\x1bP0;1|17/6C730A\x1b\\",
    "modifyOtherKeys": b"\x1b[>4;2m",
    "ENQ answerback": b"\x05",
    "DECID": b"\x1bZ",
    "APC and PM": b"\x1b_payload\x1b\\\x1b^privacy\x1b\\",
}


@pytest.mark.parametrize("sequence", ACTING.values(), ids=ACTING.keys())
def test_sequences_that_act_on_the_terminal_are_dropped_whole(sequence: bytes) -> None:
    assert TerminalFilter().feed(b"a" + sequence + b"z") == b"az"


@pytest.mark.parametrize("sequence", ACTING.values(), ids=ACTING.keys())
def test_they_are_dropped_whatever_the_chunks(sequence: bytes) -> None:
    data = b"a" + sequence + b"z"
    screen = TerminalFilter()
    assert b"".join(screen.feed(data[i : i + 1]) for i in range(len(data))) + screen.feed(b"", final=True) == b"az"


def test_drawing_passes_unchanged() -> None:
    drawing = ("plain \u00e9t\u00e9 \u2603\r\n\ttab\b\x07 \x1b[1;31mred\x1b[0m \x1b[2J\x1b[H\x1b[10;20H\x1b[K"
               "\x1b[?1049h\x1b[?25l\x1b[?2004h\x1b[3;20r\x1b7\x1b8\x1b(0qqq\x1b(B\x1bM").encode()
    assert TerminalFilter().feed(drawing) == drawing


def test_an_unterminated_string_is_given_up_and_what_follows_shows() -> None:
    screen = TerminalFilter()
    shown = screen.feed(b"\x1b]52;c;" + b"A" * (MAX_STRING + 10) + b"visible")
    assert shown.endswith(b"visible") and set(shown[:-7]) == {ord("A")} and len(shown) < 30


def test_c1_controls_are_dropped_and_bytes_that_are_not_utf8_replaced() -> None:
    """An 8-bit CSI or OSC (U+009B, U+009D) starts nothing: what follows it is plain text."""
    assert TerminalFilter().feed("a\u009b6n\u009d52;c;eA==\u009cz".encode()) == b"a6n52;c;eA==z"
    assert TerminalFilter().feed(b"a\x9b6nb\xff") == "a\ufffd6nb\ufffd".encode()
