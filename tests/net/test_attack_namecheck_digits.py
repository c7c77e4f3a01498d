"""Issue 40 finding: a Content-Length of Unicode digits (latin-1 ², ³, ¹: str.isdigit() is true, int()
fails) raised ValueError out of the HTTP framer: the name check's thread died with a traceback in the
service log and the connection was reset without an egress record. It is refused like every other
malformed Content-Length (runner/net/namecheck.py `_framing`)."""

from __future__ import annotations

import pytest

from runner.net.namecheck import BAD_HTTP, HttpRequests, parse_head

HEAD = b"POST /simple/x HTTP/1.1\r\nHost: plain.test\r\nContent-Length: \xb2"


@pytest.mark.parametrize("digit", [b"\xb2", b"\xb3", b"\xb9", b"1\xb2"])
def test_unicode_digits_in_content_length_are_refused_not_raised(digit):
    claim, _ = parse_head(HEAD.replace(b"\xb2", digit))
    assert claim.refusal == BAD_HTTP
    pieces = HttpRequests().feed(HEAD.replace(b"\xb2", digit) + b"\r\n\r\nab")
    assert [piece.claim.refusal for piece in pieces if piece.claim is not None] == [BAD_HTTP]
