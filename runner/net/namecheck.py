"""Reading the name a TCP connection claims from its first flight: TLS ClientHello SNI or HTTP Host.

Pure functions over bytes the guest sent, so everything here is hostile input: every length is
checked against what is left, every size is bounded, and anything that is not plainly one of the
two shapes is a refusal with a reason, never a guess. The proxy (`runner.net.nameproxy`) decides
what a claimed name may reach; this module only says which name was claimed, or why none can be.

What is refused whatever the policy says, and why:

- neither a TLS handshake record nor an HTTP/1.x request line: the name cannot be read;
- a ClientHello without `server_name`, with more than one name in it, or with the
  `encrypted_client_hello` (or the older `encrypted_server_name`) extension: the name that routes
  the connection at a CDN would then be one the host cannot see;
- duplicate TLS extensions, lengths that do not add up, a ClientHello past `MAX_HELLO_BYTES`;
- HTTP that a front end could read differently from the check (request smuggling and host
  switching): bare LF or CR, header continuation lines, whitespace before a colon, no or several
  `Host` headers, an absolute-form target naming another host than `Host`, a target with a
  fragment (`#`), both `Content-Length`
  and `Transfer-Encoding`, a transfer coding other than `chunked`, `CONNECT` and `Upgrade` (after
  them the bytes are no longer HTTP this parser can follow), heads past `MAX_HEAD_BYTES`.

A kept-alive connection is followed request by request (`HttpRequests`), so every request's Host
is checked before its bytes are passed on, however the guest splits or pipelines them; a request
with a body is the last one passed on (`Connection: close`), since a server may leave its body
unread and read it as a request.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Literal
from urllib.parse import urlsplit

from policy.model import OVERRIDE_HEADERS, form_type, query_overrides

MAX_HELLO_BYTES = 32 * 1024  # a post-quantum ClientHello is ~2 KiB; 16 KiB of padding still fits
MAX_RECORD_BYTES = 16384 + 256  # TLS plaintext records are at most 2^14 (a little slack for old stacks)
MAX_HEAD_BYTES = 16 * 1024  # an HTTP request line and its headers (h11's and nginx's default size)
MAX_HEADERS = 100
MAX_CHUNK_LINE = 1024  # a chunk-size line with its extensions; trailers share MAX_HEAD_BYTES
_EXT_SERVER_NAME = 0
_EXT_ECH = 0xFE0D  # encrypted_client_hello (RFC 9460 / draft-ietf-tls-esni)
_EXT_ESNI = 0xFFCE  # the older encrypted_server_name drafts
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
_VERSION = re.compile(rb"HTTP/1\.[01]")
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_BARE = re.compile(rb"(?<!\r)\n|\r(?=[^\n])")  # a LF without its CR, or a CR followed by anything but LF

Kind = Literal["tls", "http", "tcp"]  # "tcp": neither of the two

# Why no name could be accepted (the `refusal` of a Claim); the audit record carries the reason
# `policy.suggest.UNNAMED` and the service log this detail.
NOT_TLS_OR_HTTP = "neither a TLS ClientHello nor an HTTP/1 request"
NO_SNI = "TLS ClientHello without a server name (SNI)"
ECH = "TLS ClientHello with encrypted_client_hello: the real name is hidden"
BAD_TLS = "malformed TLS ClientHello"
BAD_NAME = "the claimed name is not a DNS name"
BAD_HTTP = "malformed HTTP request"
NO_HOST = "HTTP request without exactly one Host header"
HOST_MISMATCH = "HTTP absolute-form target names another host than Host"
TOO_LARGE = "first flight larger than the check reads"
UNSUPPORTED_HTTP = "HTTP CONNECT or Upgrade: the bytes after it cannot be checked"


@dataclass(frozen=True)
class Claim:
    """What one TLS handshake or HTTP request says it is for.

    `name` is the claimed host, lower-case without a trailing dot, when it is a DNS name (else None);
    `refusal` is why the claim is refused whatever the policy, or None when only the policy decides.
    `method`/`path` are the HTTP request's (None for TLS); `body` whether its head announces a body
    (a Content-Length above 0, or chunked), `overrides` the `policy.model.OVERRIDE_HEADERS` and the
    `policy.model.query_overrides` (`?_method`) it carries, and `form` whether its body could be read
    as form fields (`policy.model.form_type`): what a `methods:`/`paths:` rule refuses besides the
    method and path.
    """

    kind: Kind
    name: str | None
    refusal: str | None = None
    method: str | None = None
    path: str | None = None
    body: bool = False
    overrides: tuple[str, ...] = ()
    form: bool = False


def normalise_name(raw: str) -> str | None:
    """`raw` as a policy compares names: lower-case, one trailing dot dropped; None when it is not
    a DNS name (an IP literal, empty labels, odd characters, too long)."""
    name = raw.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253:
        return None
    try:
        ip_address(name)
        return None
    except ValueError:
        pass
    labels = name.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        return None
    return name


def first_kind(data: bytes) -> Kind | None:
    """Which parser the first byte calls for: 0x16 is a TLS handshake record, a letter an HTTP method."""
    if not data:
        return None
    if data[0] == 0x16:
        return "tls"
    if 0x41 <= data[0] <= 0x5A:
        return "http"
    return None


def read_first(data: bytes) -> Claim | None:
    """The claim of a connection's first bytes, or None while more are needed to decide."""
    kind = first_kind(data)
    if kind == "tls":
        return client_hello(data)
    if kind == "http":
        requests = HttpRequests()
        pieces = requests.feed(data)
        return next((piece.claim for piece in pieces if piece.claim is not None), None)
    return Claim("tcp", None, NOT_TLS_OR_HTTP) if data else None


# -- TLS --------------------------------------------------------------------------------------------


class _Short(Exception):
    """A length points past the bytes there are: malformed once the whole message is there."""


class _Reader:
    """Bounds-checked reads over one byte string."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, size: int) -> bytes:
        if size < 0 or self.at + size > len(self.data):
            raise _Short()
        piece = self.data[self.at:self.at + size]
        self.at += size
        return piece

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "big")

    def vector(self, length_size: int) -> bytes:
        return self.take(self.uint(length_size))

    def done(self) -> bool:
        return self.at == len(self.data)


def client_hello(data: bytes) -> Claim | None:
    """The claim of a TLS connection's first bytes, or None while the ClientHello is incomplete.

    The handshake message may span several records (legal, and what a large hello does); only
    handshake records are read, and each is bounded like the whole hello.
    """
    handshake = b""
    at = 0
    while True:
        if len(data) - at < 5:
            return None if len(data) < MAX_HELLO_BYTES else Claim("tls", None, TOO_LARGE)
        kind, major, _minor, length = struct.unpack_from("!BBBH", data, at)
        if kind != 0x16 or major != 3 or length == 0 or length > MAX_RECORD_BYTES:
            return Claim("tls", None, BAD_TLS)
        if len(data) - at - 5 < length:
            return None if len(data) < MAX_HELLO_BYTES + 5 else Claim("tls", None, TOO_LARGE)
        handshake += data[at + 5:at + 5 + length]
        at += 5 + length
        if len(handshake) >= 4:
            if handshake[0] != 1:
                return Claim("tls", None, BAD_TLS)
            size = int.from_bytes(handshake[1:4], "big")
            if size > MAX_HELLO_BYTES:
                return Claim("tls", None, TOO_LARGE)
            if len(handshake) >= 4 + size:
                if len(handshake) > 4 + size:  # another handshake message in the first flight: not a client's
                    return Claim("tls", None, BAD_TLS)
                return _hello_claim(handshake[4:])
        if at > MAX_HELLO_BYTES + 5:
            return Claim("tls", None, TOO_LARGE)


def _hello_claim(body: bytes) -> Claim:
    try:
        extensions = _extensions(body)
    except _Short:
        return Claim("tls", None, BAD_TLS)
    if extensions is None:
        return Claim("tls", None, BAD_TLS)
    sni = extensions.get(_EXT_SERVER_NAME)
    name = None
    if sni is not None:
        try:
            raw = _server_name(sni)
        except _Short:
            return Claim("tls", None, BAD_TLS)
        if raw is None:
            return Claim("tls", None, BAD_TLS)
        name = normalise_name(raw)
        if name is None:
            return Claim("tls", None, BAD_NAME)
    if _EXT_ECH in extensions or _EXT_ESNI in extensions:
        return Claim("tls", name, ECH)
    if name is None:
        return Claim("tls", None, NO_SNI)
    return Claim("tls", name)


def _extensions(body: bytes) -> dict[int, bytes] | None:
    """The ClientHello's extensions by type; None when duplicated or left-over bytes remain."""
    reader = _Reader(body)
    reader.take(2 + 32)  # legacy_version, random
    if len(reader.vector(1)) > 32:  # legacy_session_id
        return None
    suites = reader.vector(2)
    if not suites or len(suites) % 2:
        return None
    if not reader.vector(1):  # legacy_compression_methods: at least "null"
        return None
    if reader.done():
        return {}  # no extensions at all (an SSL 3.0 style hello): no SNI
    block = _Reader(reader.vector(2))
    if not reader.done():
        return None
    found: dict[int, bytes] = {}
    while not block.done():
        kind = block.uint(2)
        value = block.vector(2)
        if kind in found:
            return None
        found[kind] = value
    return found


def _server_name(value: bytes) -> str | None:
    """The one host_name of a server_name extension; None for none, several, or non-ASCII."""
    outer = _Reader(value)
    names = _Reader(outer.vector(2))
    if not outer.done():
        return None
    found: list[bytes] = []
    while not names.done():
        kind = names.uint(1)
        entry = names.vector(2)
        if kind == 0:
            found.append(entry)
    if len(found) != 1 or not found[0] or not found[0].isascii():
        return None
    return found[0].decode("ascii")


# -- HTTP -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Bytes of the guest's request stream the parser has framed: a request head (with its
    `claim`, to be checked before `data` is passed on) or body bytes of an admitted request.
    A refused claim's `data` is everything the parser held from that point on (audit mode
    passes it on unframed; block mode never does). `body` marks a body's own bytes (chunked
    framing lines excluded): what a scan of the body reads as one stream. `after_close` marks what
    the guest sent after a request with a body had ended (`HttpRequests`): it must not go upstream
    on this connection."""

    data: bytes
    claim: Claim | None = None
    body: bool = False
    after_close: bool = False


@dataclass
class HttpRequests:
    """Frames a client's HTTP/1.x byte stream into request heads and bodies, request by request.

    `feed` returns what can be framed so far; a head is returned only once it is complete, so no
    byte of a request leaves before its Host is known. A refused claim ends the stream: feeding
    more after it is an error. Bodies are followed by Content-Length or chunked framing, which is
    what lets the next request on a kept-alive or pipelined connection be found and checked.

    A request with a body is the last one a connection carries upstream: a server may answer it
    without reading its body (an auth check answering 401) and keep the connection, and then read
    that body as a request the host never checked. So its head goes out with `Connection: close`
    (the guest's `Connection`, `Keep-Alive` and `Proxy-Connection` headers replaced: an HTTP/1.1
    server closes after answering it), and once its body is framed `closed_after` is set: what the
    guest sends later is still framed (a refused request is still recorded) but marked
    `after_close`, never to be passed on; the guest's client sees the connection end after the
    response and opens a new one.
    """

    buffer: bytes = b""
    body_left: int = 0  # bytes of a Content-Length body (or of the current chunk's data) still due
    state: Literal["head", "length", "chunk-size", "chunk-data", "chunk-crlf", "trailers", "closed"] = "head"
    pieces: list[Piece] = field(default_factory=list)
    closed_after: bool = False  # a request with a body has ended: nothing more goes upstream
    closing: bool = False  # the request being framed has a body: `closed_after` once it ends

    def feed(self, data: bytes) -> list[Piece]:
        if self.state == "closed":
            raise ValueError("the request stream was refused; nothing more may be fed")
        self.buffer += data
        self.pieces = []
        while self.buffer and self._step():
            pass
        return self.pieces

    def _step(self) -> bool:
        """Frame what the buffer allows in the current state; False when more bytes are needed."""
        if self.state == "head":
            return self._head()
        if self.state in ("length", "chunk-data"):
            take = self.buffer[:self.body_left]
            self.buffer = self.buffer[len(take):]
            self.body_left -= len(take)
            self.pieces.append(Piece(take, body=True, after_close=self.closed_after))
            if self.body_left == 0:
                if self.state == "length":
                    self._request_done()
                else:
                    self.state = "chunk-crlf"
            return True
        if self.state == "chunk-crlf":
            if len(self.buffer) < 2:
                return False
            if self.buffer[:2] != b"\r\n":
                return self._refuse(BAD_HTTP)
            self._emit(2)
            self.state = "chunk-size"
            return True
        if self.state == "chunk-size":
            return self._chunk_size()
        return self._trailers()

    def _head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                return self._refuse(TOO_LARGE)
            if _BARE.search(self.buffer):  # a bare CR or LF: no need to wait for the rest
                return self._refuse(BAD_HTTP)
            line_end = self.buffer.find(b"\r\n")
            if line_end >= 0 and not _request_line(self.buffer[:line_end]):  # e.g. SSH's banner
                return self._refuse(BAD_HTTP)
            return False
        if end + 4 > MAX_HEAD_BYTES:
            return self._refuse(TOO_LARGE)
        head = self.buffer[:end + 4]
        claim, framing = parse_head(head[:end])
        if claim.refusal is not None:
            self.pieces.append(Piece(self.buffer, claim, after_close=self.closed_after))
            self.state = "closed"
            self.buffer = b""
            return False
        self.buffer = self.buffer[end + 4:]
        if framing != 0:
            head = closing_head(head)
            self.closing = True
        self.pieces.append(Piece(head, claim, after_close=self.closed_after))
        if framing == "chunked":
            self.state = "chunk-size"
        elif framing > 0:
            self.state, self.body_left = "length", framing
        return True

    def _request_done(self) -> None:
        """A request's body has ended: the next bytes are a new request's head."""
        self.state = "head"
        if self.closing:
            self.closed_after = True

    def _chunk_size(self) -> bool:
        end = self.buffer.find(b"\r\n")
        if end < 0:
            return len(self.buffer) > MAX_CHUNK_LINE and self._refuse(BAD_HTTP)
        line = self.buffer[:end]
        size_text = line.split(b";", 1)[0]
        if end > MAX_CHUNK_LINE or not _HEX.fullmatch(size_text) or b"\n" in line or b"\r" in line:
            return self._refuse(BAD_HTTP)
        size = int(size_text, 16)
        self._emit(end + 2)
        if size == 0:
            self.state = "trailers"
        else:
            self.state, self.body_left = "chunk-data", size
        return True

    def _trailers(self) -> bool:
        if self.buffer.startswith(b"\r\n"):
            self._emit(2)
            self._request_done()
            return True
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return len(self.buffer) > MAX_HEAD_BYTES and self._refuse(TOO_LARGE)
        if _header_lines(self.buffer[:end]) is None:
            return self._refuse(BAD_HTTP)
        self._emit(end + 4)
        self._request_done()
        return True

    def _emit(self, size: int) -> None:
        self.pieces.append(Piece(self.buffer[:size], after_close=self.closed_after))
        self.buffer = self.buffer[size:]

    def _refuse(self, why: str) -> bool:
        self.pieces.append(Piece(self.buffer, Claim("http", None, why), after_close=self.closed_after))
        self.state = "closed"
        self.buffer = b""
        return False


Framing = int | Literal["chunked"]  # a Content-Length (0: no body) or chunked
_HOP_BY_HOP = (b"connection", b"keep-alive", b"proxy-connection")


def closing_head(head: bytes) -> bytes:
    """A request head (with its final blank line) as it goes upstream when the request has a body:
    its `Connection`, `Keep-Alive` and `Proxy-Connection` headers replaced by `Connection: close`."""
    lines = head[:-4].split(b"\r\n")
    kept = [lines[0]] + [line for line in lines[1:] if line.partition(b":")[0].lower() not in _HOP_BY_HOP]
    return b"\r\n".join([*kept, b"Connection: close"]) + b"\r\n\r\n"


def parse_head(head: bytes) -> tuple[Claim, Framing]:
    """The claim and body framing of one request head (without its final blank line)."""
    lines = head.split(b"\r\n")
    parts = _request_line(lines[0])
    if parts is None:
        return Claim("http", None, BAD_HTTP), 0
    method, target = parts
    headers = _header_lines(b"\r\n".join(lines[1:]))
    if headers is None or _BARE.search(head) or head.endswith(b"\r"):
        return Claim("http", None, BAD_HTTP, method), 0
    hosts = [value for key, value in headers if key == "host"]
    if len(hosts) != 1:
        return Claim("http", None, NO_HOST, method), 0
    name = _host_name(hosts[0])
    path, target_host, query = _target(target)
    if method == "CONNECT" or any(key == "upgrade" for key, _ in headers):
        return Claim("http", name, UNSUPPORTED_HTTP, method, path), 0
    if path is None:
        return Claim("http", name, BAD_HTTP, method), 0
    if name is None:
        return Claim("http", None, BAD_NAME, method, path), 0
    if target_host is not None and _host_name(target_host) != name:
        return Claim("http", name, HOST_MISMATCH, method, path), 0
    framing = _framing(headers)
    if framing is None:
        return Claim("http", name, BAD_HTTP, method, path), 0
    overrides = tuple(sorted({key.replace("_", "-") for key, _ in headers} & OVERRIDE_HEADERS)) \
        + query_overrides(query)
    form = framing != 0 and form_type([value for key, value in headers if key.replace("_", "-") == "content-type"])
    return Claim("http", name, None, method, path, framing != 0, overrides, form), framing


def _request_line(line: bytes) -> tuple[str, str] | None:
    """(method, target) of `METHOD SP target SP HTTP/1.x`, or None."""
    parts = line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]) \
            or not _VERSION.fullmatch(parts[2]):
        return None
    return parts[0].decode(), parts[1].decode()


def _header_lines(block: bytes) -> list[tuple[str, str]] | None:
    """(lower-case name, value) of each header line; None for a continuation line, whitespace
    before the colon, a bad name, or more than MAX_HEADERS."""
    if not block:
        return []
    lines = block.split(b"\r\n")
    if len(lines) > MAX_HEADERS:
        return None
    found: list[tuple[str, str]] = []
    for line in lines:
        key, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(key) or any(byte < 0x20 and byte != 0x09 or byte == 0x7F for byte in value):
            return None
        found.append((key.decode().lower(), value.strip(b" \t").decode("latin-1")))
    return found


def _host_name(value: str) -> str | None:
    """The name of a Host value (`name` or `name:port`); None for an IP literal or a bad name."""
    if value.startswith("["):
        return None
    name, _, port = value.partition(":")
    if port and not port.isdigit():
        return None
    return normalise_name(name)


def _target(target: str) -> tuple[str | None, str | None, str]:
    """(path, host, query) of a request target: origin-form has no host, absolute-form names one,
    `*` (OPTIONS) has the path `*`; anything else has no path, and so has a target with a fragment
    (`#`: no client sends one, and a server could read the path up to it or past it)."""
    if "#" in target:
        return None, None, ""
    if target == "*":
        return "*", None, ""
    if target.startswith("/"):
        path, _, query = target.partition("?")
        return path, None, query
    if target[:7].lower() == "http://" or target[:8].lower() == "https://":
        try:
            parts = urlsplit(target)
        except ValueError:
            return None, None, ""
        if parts.username is not None or parts.password is not None or not parts.netloc:
            return None, None, ""
        return parts.path or "/", parts.netloc, target.partition("?")[2]
    return None, None, ""


def _framing(headers: list[tuple[str, str]]) -> Framing | None:
    """How the body is framed, or None when a front end could read it another way."""
    lengths = {value for key, value in headers if key == "content-length"}
    codings = [value for key, value in headers if key == "transfer-encoding"]
    if codings:
        if lengths or len(codings) != 1 or codings[0].lower() != "chunked":
            return None
        return "chunked"
    if not lengths:
        return 0
    if len(lengths) != 1:
        return None
    (length,) = lengths
    if not (length.isascii() and length.isdigit()) or len(length) > 18:  # '²' is a digit to isdigit()
        return None
    return int(length)
