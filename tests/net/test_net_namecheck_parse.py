"""The first-flight parser (`runner.net.namecheck`) against hostile inputs: pure, no namespaces."""

from __future__ import annotations

import random
import ssl
import struct

import pytest

from runner.net import namecheck as nc
from runner.net.namecheck import Claim, HttpRequests, client_hello, normalise_name, read_first


def hello(sni: str | None) -> bytes:
    context = ssl.create_default_context()
    context.check_hostname = False
    out = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), out, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return out.read()


def build_hello(extensions: list[tuple[int, bytes]], raw_block: bytes | None = None) -> bytes:
    """A ClientHello record with exactly these extensions (or this raw extensions block)."""
    block = raw_block if raw_block is not None else b"".join(
        struct.pack("!HH", kind, len(value)) + value for kind, value in extensions)
    body = b"\x03\x03" + bytes(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00" + struct.pack("!H", len(block)) + block
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


def sni(*names: bytes, kind: int = 0) -> tuple[int, bytes]:
    entries = b"".join(bytes([kind]) + struct.pack("!H", len(name)) + name for name in names)
    return 0, struct.pack("!H", len(entries)) + entries


def test_a_real_client_hello_names_its_server_normalised() -> None:
    assert client_hello(hello("PyPI.org")) == Claim("tls", "pypi.org")
    assert client_hello(build_hello([sni(b"files.pythonhosted.org.")])) == Claim("tls", "files.pythonhosted.org")


def test_every_prefix_of_a_hello_asks_for_more() -> None:
    record = hello("pypi.org")
    for end in range(len(record)):
        assert client_hello(record[:end]) is None, end


def test_a_hello_split_over_records_is_reassembled() -> None:
    record = hello("pypi.org")
    handshake = record[5:]
    split = b"".join(b"\x16\x03\x01" + struct.pack("!H", len(part)) + part
                     for part in (handshake[:10], handshake[10:11], handshake[11:]))
    assert client_hello(split) == Claim("tls", "pypi.org")


@pytest.mark.parametrize(("data", "why"), [
    (hello(None), nc.NO_SNI),
    (build_hello([]), nc.NO_SNI),
    (build_hello([sni(b"pypi.org"), (0xFE0D, b"\x00")]), nc.ECH),
    (build_hello([sni(b"pypi.org"), (0xFFCE, b"")]), nc.ECH),
    (build_hello([sni(b"pypi.org"), sni(b"evil.test")]), nc.BAD_TLS),  # duplicate extension
    (build_hello([sni(b"pypi.org", b"evil.test")]), nc.BAD_TLS),  # two names
    (build_hello([sni(b"")]), nc.BAD_TLS),
    (build_hello([sni(b"p\xc3\xbdpi.org")]), nc.BAD_TLS),
    (build_hello([sni(b"10.0.0.1")]), nc.BAD_NAME),
    (build_hello([sni(b"pypi.org\x00.evil")]), nc.BAD_NAME),
    (build_hello([sni(b"a..b")]), nc.BAD_NAME),
    (build_hello([], raw_block=b"\x00\x00\x00\x10"), nc.BAD_TLS),  # extension longer than its block
    (b"\x16\x03\x01\x00\x00", nc.BAD_TLS),
    (b"\x16\x02\x00\x00\x05hello", nc.BAD_TLS),
    (b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00", nc.BAD_TLS),  # a ServerHello
    (b"\x16\x03\x01\x00\x04\x01\xff\xff\xff", nc.TOO_LARGE),
])
def test_hellos_that_hide_or_fake_the_name_are_refused(data: bytes, why: str) -> None:
    claim = client_hello(data)
    assert claim is not None and claim.refusal == why


def test_trailing_handshake_bytes_in_the_hello_record_are_refused() -> None:
    record = hello("pypi.org")
    handshake = record[5:] + b"\x01\x00\x00\x00"
    assert client_hello(b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake) == Claim("tls", None, nc.BAD_TLS)


def test_random_garbage_never_raises_and_is_bounded() -> None:
    rng = random.Random(18)
    base = hello("pypi.org")
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        claim = client_hello(bytes(data))
        assert claim is None or isinstance(claim, Claim)
        if claim is not None and claim.refusal is None:
            assert claim.name is not None and normalise_name(claim.name) == claim.name
    assert client_hello(b"\x16\x03\x01\x40\x00" + bytes(0x4000) * 3) is not None  # never waits past the cap


def test_names_are_normalised_or_refused() -> None:
    assert normalise_name("PyPI.ORG.") == "pypi.org"
    for bad in ("", ".", "a..b", "1.2.3.4", "::1", "a b", "-a.org", "a.123", "x" * 64 + ".org", "é.org", "a.org.."):
        assert normalise_name(bad) is None, bad


def claims(*chunks: bytes) -> list[Claim | None]:
    stream = HttpRequests()
    found: list[Claim | None] = []
    for chunk in chunks:
        found += [piece.claim for piece in stream.feed(chunk) if piece.claim is not None]
    return found


def test_http_request_claims_its_host_method_and_path() -> None:
    assert read_first(b"GET /simple/x/?a=1 HTTP/1.1\r\nHost: PyPI.org:443\r\nAccept: */*\r\n\r\n") == \
        Claim("http", "pypi.org", None, "GET", "/simple/x/")
    assert read_first(b"GET http://pypi.org/simple/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n") == \
        Claim("http", "pypi.org", None, "GET", "/simple/")
    assert read_first(b"GET / HTTP/1.1\r\nHost: pypi.org\r\n") is None  # not complete yet


def test_a_claim_says_whether_a_body_comes_and_which_override_headers_it_carries() -> None:
    head = b"GET /simple/ HTTP/1.1\r\nHost: pypi.org\r\n"
    assert read_first(head + b"Content-Length: 0\r\n\r\n") == Claim("http", "pypi.org", None, "GET", "/simple/")
    # no Content-Type: Rack reads such a body as a form (`form`, policy.model.form_type)
    assert read_first(head + b"Content-Length: 5\r\n\r\n") == \
        Claim("http", "pypi.org", None, "GET", "/simple/", True, form=True)
    assert read_first(head + b"Transfer-Encoding: chunked\r\nContent-Type: application/octet-stream\r\n\r\n") == \
        Claim("http", "pypi.org", None, "GET", "/simple/", True)
    assert read_first(head + b"Content-Length: 5\r\nContent-Type: Multipart/Form-Data; boundary=x\r\n\r\n") == \
        Claim("http", "pypi.org", None, "GET", "/simple/", True, form=True)
    assert read_first(head + b"Content-Type: application/json\r\n\r\n") == \
        Claim("http", "pypi.org", None, "GET", "/simple/")  # no body: nothing a form could say
    overridden = read_first(head + b"X-HTTP-Method-Override: POST\r\nx_original_url: /upload\r\n\r\n")
    assert overridden == Claim("http", "pypi.org", None, "GET", "/simple/", False,
                               ("x-http-method-override", "x-original-url"))  # CGI reads _ as -


@pytest.mark.parametrize(("target", "overrides"), [
    (b"/simple/form?_method=DELETE", ("?_method",)),
    (b"/simple/form?a=1&%5FMETHOD=DELETE", ("?%5FMETHOD",)),
    (b"/simple/form?a=1;.method=DELETE", ("?.method",)),  # PHP reads .method as _method; Rack 2 splits at ;
    (b"http://pypi.org/simple/form?_method=PUT", ("?_method",)),
    (b"/simple/form?X-HTTP-Method-Override=PUT", ("?X-HTTP-Method-Override",)),  # ASP.NET MVC reads the query
    (b"/simple/form?method=flickr.photos.search&_methodx=1", ()),
])
def test_a_claim_carries_the_query_parameters_frameworks_read_as_the_method(target: bytes,
                                                                          overrides: tuple[str, ...]) -> None:
    claim = read_first(b"POST " + target + b" HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: 0\r\n\r\n")
    assert claim == Claim("http", "pypi.org", None, "POST", "/simple/form", False, overrides)


def test_a_request_with_a_body_is_the_last_its_connection_carries_upstream() -> None:
    hidden = b"DELETE /upload/x HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: 0\r\n\r\n"
    stream = (b"GET /a HTTP/1.1\r\nHost: pypi.org\r\nConnection: keep-alive\r\n\r\n"
              + b"POST /b HTTP/1.1\r\nHost: pypi.org\r\nconnection: keep-alive, x-a\r\nKeep-Alive: 60\r\n"
              + b"Proxy-Connection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(hidden) + hidden
              + b"GET /c HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    for size in (1, 5, len(stream)):
        parser = HttpRequests()
        pieces = [piece for at in range(0, len(stream), size) for piece in parser.feed(stream[at:at + size])]
        sent = b"".join(piece.data for piece in pieces if not piece.after_close)
        assert sent == (b"GET /a HTTP/1.1\r\nHost: pypi.org\r\nConnection: keep-alive\r\n\r\n"
                        b"POST /b HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                        % len(hidden) + hidden), size
        later = [piece for piece in pieces if piece.after_close]
        assert b"".join(piece.data for piece in later) == b"GET /c HTTP/1.1\r\nHost: evil.test\r\n\r\n"
        assert [piece.claim.name for piece in later if piece.claim is not None] == ["evil.test"]  # still claimed
        assert parser.closed_after
    chunked = HttpRequests()
    pieces = chunked.feed(b"PUT /d HTTP/1.1\r\nHost: pypi.org\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"
                          b"0\r\nX-Trailer: 1\r\n\r\nGET /e HTTP/1.1\r\nHost: pypi.org\r\n\r\n")
    assert pieces[0].data.endswith(b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    assert [piece.after_close for piece in pieces] == [False] * (len(pieces) - 1) + [True]


@pytest.mark.parametrize(("head", "why"), [
    (b"GET / HTTP/1.1\r\n\r\n", nc.NO_HOST),
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", nc.NO_HOST),
    (b"GET / HTTP/1.1\r\nHost: a.test\r\nhOsT: a.test\r\n\r\n", nc.NO_HOST),
    (b"GET http://evil.test/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n", nc.HOST_MISMATCH),
    (b"GET http://user@pypi.org/ HTTP/1.1\r\nHost: pypi.org\r\n\r\n", nc.BAD_HTTP),
    (b"GET / HTTP/1.1\r\nHost : pypi.org\r\n\r\n", nc.BAD_HTTP),
    (b"GET / HTTP/1.1\r\nX: a\r\n Host: evil.test\r\nHost: pypi.org\r\n\r\n", nc.BAD_HTTP),  # folded line
    (b"GET / HTTP/1.1\nHost: pypi.org\n\n", nc.BAD_HTTP),
    (b"GET / HTTP/1.1\r\nHost: pypi.org\rX: y\r\n\r\n", nc.BAD_HTTP),
    (b"GET  / HTTP/1.1\r\nHost: pypi.org\r\n\r\n", nc.BAD_HTTP),
    (b"GET / HTTP/2.0\r\nHost: pypi.org\r\n\r\n", nc.BAD_HTTP),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", nc.BAD_HTTP),
    (b"GET / HTTP/1.1\r\nHost: 203.0.113.10\r\n\r\n", nc.BAD_NAME),
    (b"GET / HTTP/1.1\r\nHost: [::1]\r\n\r\n", nc.BAD_NAME),
    (b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org\r\n\r\n", nc.UNSUPPORTED_HTTP),
    (b"GET / HTTP/1.1\r\nHost: pypi.org\r\nUpgrade: h2c\r\n\r\n", nc.UNSUPPORTED_HTTP),
    (b"POST / HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", nc.BAD_HTTP),
    (b"POST / HTTP/1.1\r\nHost: pypi.org\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", nc.BAD_HTTP),
    (b"POST / HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", nc.BAD_HTTP),
    (b"POST / HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: -3\r\n\r\n", nc.BAD_HTTP),
    (b"GET / HTTP/1.1\r\nHost: pypi.org\r\nX: " + b"a" * nc.MAX_HEAD_BYTES + b"\r\n\r\n", nc.TOO_LARGE),
    (b"GET /simple/x#/../../upload HTTP/1.1\r\nHost: pypi.org\r\n\r\n", nc.BAD_HTTP),  # a fragment
    (b"GET http://pypi.org/simple/x#/../../upload HTTP/1.1\r\nHost: pypi.org\r\n\r\n", nc.BAD_HTTP),
])
def test_smuggling_shaped_requests_are_refused(head: bytes, why: str) -> None:
    assert [claim.refusal for claim in claims(head) if claim is not None] == [why]


def test_an_endless_head_is_refused_without_waiting_for_its_end() -> None:
    stream = HttpRequests()
    refused = []
    for _ in range(nc.MAX_HEAD_BYTES // 1000 + 2):
        refused += [piece for piece in stream.feed(b"X" * 1000) if piece.claim is not None]
        if refused:
            break
    assert refused and refused[0].claim is not None and refused[0].claim.refusal == nc.TOO_LARGE
    assert claims(b"GET / HTTP/1.1\nHost")[0] == Claim("http", None, nc.BAD_HTTP)  # a bare LF: at once


def test_pipelined_and_kept_alive_requests_are_each_claimed_wherever_the_bytes_split() -> None:
    body = b"Host: evil.test\r\n\r\n"
    stream = (b"POST /up HTTP/1.1\r\nHost: pypi.org\r\nContent-Length: %d\r\n\r\n" % len(body) + body
              + b"POST /c HTTP/1.1\r\nHost: pypi.org\r\nTransfer-Encoding: chunked\r\n\r\n"
              + b"5;x=y\r\nHost:\r\n0\r\nTrailer: 1\r\n\r\n"
              + b"GET /b HTTP/1.1\r\nHost: files.test\r\n\r\n")
    expected = ["pypi.org", "pypi.org", "files.test"]
    for size in (1, 2, 3, 7, 64, len(stream)):
        parser = HttpRequests()
        pieces = [piece for at in range(0, len(stream), size) for piece in parser.feed(stream[at:at + size])]
        assert [piece.claim.name for piece in pieces if piece.claim is not None] == expected, size
        # every byte framed exactly once (a head with a body asks the server to close after it)
        assert b"".join(piece.data for piece in pieces) == stream.replace(
            b"\r\n\r\n" + body, b"\r\nConnection: close\r\n\r\n" + body).replace(
            b"chunked\r\n\r\n", b"chunked\r\nConnection: close\r\n\r\n")
        assert all(piece.after_close for piece in pieces[pieces.index(next(
            piece for piece in pieces if piece.claim is not None and piece.claim.path == "/c")):])
        for piece in pieces:  # a head's bytes come only with its claim
            if piece.claim is not None:
                assert piece.data.startswith(piece.claim.method.encode())  # type: ignore[union-attr]


def test_a_refused_request_keeps_its_bytes_out_of_the_admitted_pieces() -> None:
    parser = HttpRequests()
    pieces = parser.feed(b"GET / HTTP/1.1\r\nHost: pypi.org\r\n\r\nGET / HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    assert [(piece.claim.name if piece.claim else None) for piece in pieces] == ["pypi.org", "evil.test"]
    assert pieces[0].data == b"GET / HTTP/1.1\r\nHost: pypi.org\r\n\r\n"
    assert parser.feed is not None and parser.state == "head"  # the proxy, not the parser, refuses a name
    bad = HttpRequests()
    refused = bad.feed(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n5\r\n")  # no body was announced: a new head
    assert refused[-1].claim is not None and refused[-1].claim.refusal == nc.BAD_HTTP
    with pytest.raises(ValueError):
        closed = HttpRequests()
        closed.feed(b"GET / HTTP/1.1\r\n\r\n")
        closed.feed(b"more")


def test_chunk_framing_errors_end_the_stream() -> None:
    for body in (b"zz\r\n", b"5\r\nHost:XX", b"1" * (nc.MAX_CHUNK_LINE + 2)):
        found = claims(b"POST / HTTP/1.1\r\nHost: pypi.org\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        assert found[0] == Claim("http", "pypi.org", None, "POST", "/", True, form=True)
        assert len(found) == 2 and found[1] is not None and found[1].refusal == nc.BAD_HTTP, body


def test_neither_tls_nor_http_is_refused_at_the_first_byte() -> None:
    for data in (b"SSH-2.0-x\r\n", b"\x00", b"\x80\x2e\x01", b"get / HTTP/1.1\r\n"):
        claim = read_first(data)
        assert claim is not None and claim.refusal is not None, data
