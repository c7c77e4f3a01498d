"""What a guest's terminal output may do to the operator's terminal: draw, nothing else.

A session attached to a job's VM (runner/service/api/attach.py) shows a hostile guest's bytes on the
operator's own terminal, where escape sequences do more than draw: OSC 52 writes the clipboard, DSR,
DA, DECRQSS, window and colour reports are answered back *as typed input* into the guest (a guest that
asks, then reads the answer, types in the operator's name), DECUDK and modifyOtherKeys remap keys, OSC
50 changes fonts, OSC 8 makes links. So output is passed through an allowlist, statefully across
chunks: text (UTF-8, the C1 controls and invalid bytes made harmless), the C0 controls that move the
cursor, and the CSI sequences that draw (cursor moves, erases, scrolling, colours, modes). Every OSC,
DCS, APC, PM and SOS string is dropped whole (up to MAX_STRING characters; an unterminated one is
given up after that and what follows is text again), as is any other control or sequence.
"""

from __future__ import annotations

import codecs

ESC = "\x1b"
TEXT_CONTROLS = frozenset("\t\n\r\b\x07")  # tab, newline, return, backspace, bell
# CSI finals that only draw: cursor moves and position, erase, insert/delete, scroll, SGR, tab stops,
# save/restore cursor, scroll region, modes (h/l). Not: n (status reports), c (device attributes), t
# (window ops and reports), p with '$' (mode reports), q (cursor style / DECRQSS-like), x, i (printing).
CSI_FINALS = frozenset("@ABCDEFGHIJKLMPSTXZ`abdefghlmrsu")
MODE_FINALS = frozenset("hl")
TWO_CHAR = frozenset("78=>DEMH")  # save/restore cursor, keypad modes, index, next line, reverse index, tab set
CHARSET_INTRO = frozenset("()*+")  # ESC ( B and friends: pick a character set, one more character
STRING_INTRO = frozenset("P]_^X")  # DCS, OSC, APC, PM, SOS: dropped to their terminator
MAX_CSI = 64
MAX_STRING = 4096


class TerminalFilter:
    """Feed it output chunks, get back what may reach a terminal; holds a sequence split across chunks."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._state = "text"
        self._seq = ""
        self._length = 0  # characters of the string being dropped
        self.dropped = 0  # sequences and controls left out

    def feed(self, data: bytes, final: bool = False) -> bytes:
        out: list[str] = []
        for char in self._decoder.decode(data, final):
            self._step(char, out)
        return "".join(out).encode()

    def _step(self, char: str, out: list[str]) -> None:
        {"text": self._in_text, "escape": self._in_escape, "charset": self._in_charset, "csi": self._in_csi,
         "string": self._in_string}[self._state](char, out)

    def _in_text(self, char: str, out: list[str]) -> None:
        if char == ESC:
            self._state = "escape"
        elif char >= " " and char != "\x7f" and not "\x80" <= char <= "\x9f":
            out.append(char)
        elif char in TEXT_CONTROLS:
            out.append(char)
        else:
            self.dropped += 1

    def _in_escape(self, char: str, out: list[str]) -> None:
        self._state = "text"
        if char == "[":
            self._state, self._seq = "csi", ""
        elif char in STRING_INTRO:
            self._state, self._seq, self._length = "string", "", 0
        elif char in CHARSET_INTRO:
            self._state, self._seq = "charset", char
        elif char in TWO_CHAR:
            out.append(ESC + char)
        else:
            self.dropped += 1
            if char == ESC:
                self._state = "escape"

    def _in_charset(self, char: str, out: list[str]) -> None:
        self._state = "text"
        if "0" <= char <= "~" and char.isascii():
            out.append(ESC + self._seq + char)
        else:
            self.dropped += 1

    def _in_csi(self, char: str, out: list[str]) -> None:
        if " " <= char <= "?" and len(self._seq) < MAX_CSI:  # parameters (0-9 ; : < = > ?) and intermediates
            self._seq += char
            return
        self._state = "text"
        if self._allowed_csi(char):
            out.append(f"{ESC}[{self._seq}{char}")
            return
        self.dropped += 1
        if not "@" <= char <= "~":  # not a final: the sequence is broken off, the character is itself again
            self._in_text(char, out)

    def _allowed_csi(self, final: str) -> bool:
        params = self._seq
        if len(params) >= MAX_CSI or any(c in params for c in "<=>:") or any(" " <= c <= "/" for c in params):
            return False  # private forms (CSI > ... m remaps keys), intermediates (CSI ? ... $ p reports), overlong
        if params.startswith("?"):
            return final in MODE_FINALS and "?" not in params[1:]
        return final in CSI_FINALS and "?" not in params

    def _in_string(self, char: str, out: list[str]) -> None:
        if char == "\x07" or (char == "\\" and self._seq.endswith(ESC)):
            self._state = "text"
            self.dropped += 1
            return
        self._seq = char  # the last character: an ESC may begin the terminator
        self._length += 1
        if self._length > MAX_STRING:
            self._state = "text"
            self.dropped += 1
