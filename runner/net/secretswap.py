"""Secrets a job can use and never read: placeholders the host swaps for real values (issue 35).

A `SecretBinding` (from the operator's config or the base branch's workflow, never from anything a
pull request controls) says where a secret may go: one host (an exact name), its ports, methods,
path globs, and the header it travels in (`Authorization: Bearer <secret>`, `Authorization: Basic
<user>:<secret>` encoded by the host, or a named header holding the value alone). The guest gets a
random per-job placeholder instead of the value (`BoundSecret.placeholder`); the host terminates
the guest's TLS to a bound host with the job's CA (`runner.net.jobca`) and, in a request the
binding admits, replaces that header's whole value with its own (`SecretSwap.swap_head`). The
placeholder anywhere else the host can read (another host, port, method or path, a body, a query
string, another header, a TLS server name, a DNS name; as sent, in any letter case, %-encoded or
base64-encoded) refuses the request (`SecretSwap.misused`).

What comes back from a bound host is read too (`ResponseMask`): requests to it ask for
`Accept-Encoding: identity`, a response that is compressed anyway is refused (the host cannot read
it), and every occurrence of the value, of the header value the host inserted, and of the value's
%-encoded and base64 forms, in headers and bodies, across reads and chunk boundaries, is replaced by
text of the same length taken from the placeholder (the placeholder itself when the value is as
long as a placeholder or longer): lengths never change, so a response's framing stays as the
upstream sent it.

What this cannot stop, and the docs say: a guest may use a binding as it allows (so bind read-only
tokens to narrow paths), and an upstream that transforms a reflected value in another way (hashes,
reverses, encrypts it) is not recognised.
"""

from __future__ import annotations

import base64
import re
import secrets
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import quote, unquote_to_bytes

from policy.model import HTTP_METHODS, Rule
from runner.errors import NetworkError, UserError

Scheme = Literal["bearer", "basic", "header"]
SCHEMES: tuple[Scheme, ...] = ("bearer", "basic", "header")
PLACEHOLDER_PREFIX = "mvcsecret"  # lower-case letters and digits only: survives DNS case folding and URLs
CORE = 32  # characters of a placeholder that identify it (prefix + 92 random bits at least)
MIN_VALUE = 8  # shorter values would be found by chance in what a bound host sends back
MAX_VALUE = 4096
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
VALUE = re.compile(r"[\x21-\x7e]+")  # a header value the host writes verbatim: visible ASCII, no space
MAX_RESPONSE_HEAD = 64 * 1024
MAX_CHUNK_LINE = 1024
_BAD_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "cookie"})


class SecretBindingError(UserError):
    """A binding that cannot be used as given; the message says what to change."""


@dataclass(frozen=True)
class SecretBinding:
    """Where one secret may be sent, and how; no value (that is `BoundSecret`'s)."""

    name: str
    env: str  # the guest's variable that holds the placeholder
    host: str  # an exact DNS name the job's policy allows (name-checked, not raw)
    header: str = "authorization"  # lower-case
    scheme: Scheme = "bearer"
    user: str | None = None  # basic only
    ports: frozenset[int] = frozenset({443})
    methods: frozenset[str] = frozenset({"GET"})
    paths: tuple[str, ...] = ("/*",)

    def __post_init__(self) -> None:
        problem = binding_problem(self)
        if problem is not None:
            raise SecretBindingError(f"secret binding {self.name!r}: {problem}")
        object.__setattr__(self, "header", self.header.lower())

    @property
    def rule(self) -> Rule:
        """Its host, ports, methods and paths as a policy rule: a request passes the binding exactly
        when it would pass such a `methods:`/`paths:` rule (ambiguous paths, bodies on GET and
        override headers refused the same way)."""
        return Rule(self.ports, "tcp", host=self.host, methods=self.methods, paths=self.paths)

    def admits(self, name: str, port: int, method: str, path: str, *, body: bool, overrides: tuple[str, ...],
               form: bool = False) -> bool:
        return self.rule.allows(port, "tcp", name=name) and self.rule.allows_request(
            method, path, body=body, overrides=overrides, form=form)

    def where(self) -> str:
        """Where it may go, in words for a refusal (no value in it)."""
        return (f"{'/'.join(sorted(self.methods))} {' '.join(self.paths)} on {self.host} port(s) "
                f"{','.join(map(str, sorted(self.ports)))}, in the {self.header} header")


def binding_problem(binding: SecretBinding) -> str | None:
    """What is wrong with a binding's fields, or None."""
    if not NAME.fullmatch(binding.name):
        return "its name must be 1-64 lower-case letters, digits, '_' or '-', starting with a letter or digit"
    if not ENV_NAME.fullmatch(binding.env):
        return f"env {binding.env!r} is not a variable name"
    if binding.host.startswith("*.") or binding.host != binding.host.lower() or not binding.host:
        return f"host {binding.host!r} must be one exact lower-case name (no wildcard)"
    if not HEADER_NAME.fullmatch(binding.header) or binding.header.lower() in _BAD_HEADERS:
        return f"header {binding.header!r} must be a header name other than {', '.join(sorted(_BAD_HEADERS))}"
    if binding.scheme not in SCHEMES:
        return f"scheme {binding.scheme!r} must be one of {', '.join(SCHEMES)}"
    if (binding.scheme == "basic") != (binding.user is not None):
        return "basic needs a user, and only basic has one"
    if binding.user is not None and not re.fullmatch(r"[\x21-\x39\x3b-\x7e]{1,256}", binding.user):
        return "the user must be visible ASCII without ':'"
    if not binding.methods or not set(binding.methods) <= set(HTTP_METHODS):
        return f"methods must be some of {', '.join(HTTP_METHODS)}"
    if not binding.paths or not all(path.startswith("/") for path in binding.paths):
        return "paths must be globs starting with /"
    if not binding.ports or not all(type(port) is int and 1 <= port <= 65535 for port in binding.ports):
        return "ports must be numbers in 1..65535"
    return None


def value_problem(value: str) -> str | None:
    """Why `value` cannot be a secret's value, or None."""
    if not MIN_VALUE <= len(value) <= MAX_VALUE:
        return f"a value must have {MIN_VALUE} to {MAX_VALUE} characters (it has {len(value)})"
    if not VALUE.fullmatch(value):
        return "a value must be visible ASCII without spaces (what a header carries verbatim)"
    if PLACEHOLDER_PREFIX in value.lower():
        return f"a value may not contain {PLACEHOLDER_PREFIX!r}"
    return None


@dataclass(frozen=True)
class BoundSecret:
    """A binding with its value for one job, and the job's placeholder for it. The value is never
    in a repr, a record or a log line."""

    binding: SecretBinding
    value: str = field(repr=False)
    placeholder: str

    @classmethod
    def make(cls, binding: SecretBinding, value: str) -> BoundSecret:
        problem = value_problem(value)
        if problem is not None:
            raise SecretBindingError(f"secret binding {binding.name!r}: {problem}")
        size = max(len(value), CORE)
        random = secrets.token_hex(size)[:size - len(PLACEHOLDER_PREFIX)]
        return cls(binding, value, PLACEHOLDER_PREFIX + random)

    @property
    def mask(self) -> str:
        """What the value becomes in a response: the placeholder, cut to the value's length."""
        return self.placeholder[:len(self.value)]

    def header_value(self, value: str) -> str:
        """The bound header's value carrying `value` (the real one, or the mask)."""
        binding = self.binding
        if binding.scheme == "bearer":
            return f"Bearer {value}"
        if binding.scheme == "basic":
            return "Basic " + base64.b64encode(f"{binding.user}:{value}".encode()).decode()
        return value

    def carries_placeholder(self, header_value: str) -> bool:
        """Whether the guest's value of the bound header is this placeholder in the binding's form
        (any user in a Basic one: the host writes its own)."""
        scheme, _, rest = header_value.partition(" ")
        if self.binding.scheme == "bearer":
            return scheme.lower() == "bearer" and rest.strip() == self.placeholder
        if self.binding.scheme == "basic":
            if scheme.lower() != "basic":
                return False
            try:
                decoded = base64.b64decode(rest.strip(), validate=True).decode("latin-1")
            except ValueError:
                return False
            return decoded.partition(":")[2] == self.placeholder
        return header_value.strip() == self.placeholder

    def reflections(self) -> list[tuple[bytes, bytes, bool]]:
        """(needle, same-length replacement, letter case folded) for every form of the value a
        response is masked for."""
        value, mask = self.value.encode(), self.mask.encode()
        found = [(value, mask, True)]
        encoded = quote(self.value, safe="").encode()
        if encoded != value:
            found.append((encoded, _fill(self.placeholder, len(encoded)), True))
        found += [(needle, _fill(self.placeholder, len(needle)), False) for needle in base64_cores(value)]
        # last: where it overlaps the forms above, the guest sees the header it sent (applied in order)
        found.append((self.header_value(self.value).encode(), self.header_value(self.mask).encode(),
                      self.binding.scheme == "bearer"))
        return [item for item in found if len(item[0]) >= MIN_VALUE]


def base64_cores(data: bytes) -> list[bytes]:
    """The base64 text that encodes `data` wherever it sits in a longer string: one form per
    alignment (0, 1 or 2 bytes before it), the characters only `data`'s own bits decide."""
    cores = []
    for before in range(3):
        text = base64.b64encode(b"\0" * before + data + b"\0\0")
        start = -(-8 * before // 6)  # the first character whose 6 bits are all data's
        end = (8 * (before + len(data))) // 6  # one past the last such character
        cores.append(text[start:end])
    return cores


def _fill(placeholder: str, size: int) -> bytes:
    return (placeholder * (size // len(placeholder) + 1))[:size].encode()


@dataclass(frozen=True)
class Misuse:
    """A placeholder where its binding does not let it go: which binding, and why (no value)."""

    binding: str
    why: str


_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")


@dataclass(frozen=True)
class SecretSwap:
    """One job's bound secrets, as the slot's name check and resolver use them."""

    secrets: tuple[BoundSecret, ...]

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({bound.binding.host for bound in self.secrets}))

    def bound(self, name: str, port: int) -> bool:
        """Whether HTTPS to `name`:`port` must be terminated for a binding (swap, response mask)."""
        return any(bound.binding.host == name and port in bound.binding.ports for bound in self.secrets)

    def bound_host(self, name: str) -> bool:
        """Whether `name` is a binding's host on any port: what it sends back is masked."""
        return any(bound.binding.host == name for bound in self.secrets)

    def misused(self, data: bytes) -> Misuse | None:
        """The binding whose placeholder `data` carries (as sent, any letter case, %-decoded up to
        three times, or base64-encoded), or None."""
        for text in _readings(data):
            for bound in self.secrets:
                core = bound.placeholder[:CORE].encode()
                if core in text:
                    return Misuse(bound.binding.name, "")
        for bound in self.secrets:
            if any(core in data for core in base64_cores(bound.placeholder[:CORE].encode())[:3]):
                return Misuse(bound.binding.name, "")
        return None

    def in_name(self, name: str) -> Misuse | None:
        """The binding whose placeholder a DNS name (or a TLS server name) spells, across labels too."""
        return self.misused(name.replace(".", "").encode())

    def longest(self) -> int:
        """How many bytes a placeholder can span in any form `misused` finds (what a stream keeps)."""
        return 3 * 3 * CORE + 8

    def swap_head(self, name: str, port: int, method: str, path: str, head: bytes, *, body: bool,
                  overrides: tuple[str, ...], form: bool = False) -> tuple[bytes, str | None] | Misuse:
        """A request head for `name`:`port` as it goes upstream: the bound header's value replaced
        where a binding admits the request (and the binding's name), `Accept-Encoding: identity`
        on a bound host; or the Misuse when a placeholder is anywhere else in it."""
        lines = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
        used: BoundSecret | None = None
        kept, checked = [lines[0]], [lines[0]]  # what goes upstream; what is searched for placeholders
        for line in lines[1:]:
            key, _, raw = line.partition(b":")
            lower = key.decode("latin-1").lower()
            bound = self._carried(lower, raw.strip(b" \t").decode("latin-1"))
            if bound is None:
                checked.append(line)
                if not (self.bound_host(name) and lower == "accept-encoding"):
                    kept.append(line)
                continue
            if used is not None:
                return Misuse(bound.binding.name, f"a second placeholder header ({lower}) in one request")
            if not bound.binding.admits(name, port, method, path, body=body, overrides=overrides, form=form):
                return Misuse(bound.binding.name, f"{method} {path} on {name} port {port} is not where it may go "
                                                  f"(only {bound.binding.where()})")
            used = bound
            kept.append(key + b": " + bound.header_value(bound.value).encode())
        misuse = self.misused(b"\r\n".join(checked))
        if misuse is not None:
            binding = next(bound.binding for bound in self.secrets if bound.binding.name == misuse.binding)
            return Misuse(misuse.binding, f"the placeholder is somewhere else than the {binding.header} header "
                                          f"of a request the binding admits (only {binding.where()})")
        if self.bound_host(name):
            kept.append(b"Accept-Encoding: identity")
        return b"\r\n".join(kept) + b"\r\n\r\n", used.binding.name if used is not None else None

    def _carried(self, header: str, value: str) -> BoundSecret | None:
        """The bound secret whose placeholder this header line carries in its binding's form."""
        for bound in self.secrets:
            if bound.binding.header == header and bound.carries_placeholder(value):
                return bound
        return None


def _readings(data: bytes) -> Iterable[bytes]:
    """`data` lower-cased, then %-decoded (up to three times, as a server decoding twice would)."""
    text = data.lower()
    yield text
    for _ in range(3):
        decoded = _PERCENT.sub(lambda match: unquote_to_bytes(match.group()), text).lower()
        if decoded == text:
            return
        text = decoded
        yield text


@dataclass
class StreamScan:
    """`SecretSwap.misused` over a stream fed in pieces: a placeholder split across reads or HTTP
    chunks is found in the piece that completes it (which is then not passed on)."""

    swap: SecretSwap
    tail: bytes = b""

    def feed(self, data: bytes) -> Misuse | None:
        window = self.tail + data
        self.tail = window[-self.swap.longest():]
        return self.swap.misused(window)

    def reset(self) -> None:
        self.tail = b""


# -- responses --------------------------------------------------------------------------------------


class ResponseRefused(NetworkError):
    """A response from a bound host the host will not pass on (it cannot mask what it cannot read)."""


@dataclass
class Masker:
    """Same-length replacement of needles in a stream: holds back as many bytes as a needle could
    still need, so one split across reads or chunks is found whole."""

    needles: list[tuple[bytes, bytes, bool]]
    tail: bytes = b""

    @property
    def hold(self) -> int:
        return max((len(needle) for needle, _, _ in self.needles), default=1) - 1

    def spans(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """(start, end, replacement) of every needle in `data`, in the needles' order."""
        folded = data.lower()
        found = []
        for needle, replacement, fold in self.needles:
            haystack, target = (folded, needle.lower()) if fold else (data, needle)
            at = haystack.find(target)
            while at >= 0:
                found.append((at, at + len(needle), replacement))
                at = haystack.find(target, at + 1)
        return found

    def apply(self, data: bytes, spans: list[tuple[int, int, bytes]] | None = None) -> bytes:
        """`data` with `spans` (default: all of them) replaced; where spans overlap, the later wins."""
        spans = self.spans(data) if spans is None else spans
        if not spans:
            return data
        out = bytearray(data)
        for start, end, replacement in spans:
            out[start:end] = replacement
        return bytes(out)

    def feed(self, data: bytes) -> bytes:
        """What of the stream may go on now, masked. The rest (as many bytes as a needle could still
        need to be complete) waits, unmasked, for more (or `flush`); the cut never splits a match,
        so a match is masked whole and a longer one is never broken up by a shorter one first."""
        window = self.tail + data
        spans = self.spans(window)
        cut = max(len(window) - self.hold, 0)
        for start, end, _ in sorted(spans):
            if start < cut < end:
                cut = end
        masked = self.apply(window, [span for span in spans if span[0] < cut])
        self.tail = window[cut:]
        return masked[:cut]

    def flush(self) -> bytes:
        out, self.tail = self.apply(self.tail), b""
        return out


ResponseState = Literal["head", "length", "chunk-size", "chunk-data", "chunk-crlf", "trailers", "close"]


@dataclass
class ResponseMask:
    """Frames a bound host's HTTP/1.x responses (one per request the host passed on, in order:
    `expect` each request's method) and masks every reflected form of the job's values in them."""

    masker: Masker
    methods: deque[str] = field(default_factory=deque)
    buffer: bytes = b""
    state: ResponseState = "head"
    left: int = 0

    @classmethod
    def of(cls, swap: SecretSwap) -> ResponseMask:
        return cls(Masker([needle for bound in swap.secrets for needle in bound.reflections()]))

    def expect(self, method: str) -> None:
        self.methods.append(method)

    def feed(self, data: bytes) -> bytes:
        """What of `data` may go to the guest now; raises ResponseRefused."""
        if self.state == "close":
            return self.masker.feed(data)
        self.buffer += data
        out = bytearray()
        while self.buffer and self._step(out):
            pass
        return bytes(out)

    def end(self) -> bytes:
        """The upstream closed: what was held back of a body that runs until then."""
        return self.masker.flush()

    def _step(self, out: bytearray) -> bool:
        if self.state == "head":
            return self._head(out)
        if self.state in ("length", "chunk-data"):
            take, self.buffer = self.buffer[:self.left], self.buffer[self.left:]
            self.left -= len(take)
            body = self.masker.feed(take)
            if self.state == "chunk-data":
                if body:
                    out += b"%x\r\n" % len(body) + body + b"\r\n"
                if self.left == 0:
                    self.state = "chunk-crlf"
            else:
                out += body
                if self.left == 0:
                    out += self.masker.flush()
                    self.state = "head"
            return True
        if self.state == "chunk-crlf":
            if len(self.buffer) < 2:
                return False
            if self.buffer[:2] != b"\r\n":
                raise ResponseRefused("a malformed chunked body")
            self.buffer, self.state = self.buffer[2:], "chunk-size"
            return True
        if self.state == "chunk-size":
            return self._chunk_size(out)
        if self.state == "close":
            out += self.masker.feed(self.buffer)
            self.buffer = b""
            return False
        return self._trailers(out)

    def _head(self, out: bytearray) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_RESPONSE_HEAD:
                raise ResponseRefused(f"a response head over {MAX_RESPONSE_HEAD} bytes")
            return False
        head, self.buffer = self.buffer[:end + 4], self.buffer[end + 4:]
        status, headers = _response_head(head[:end])
        if 100 <= status < 200:
            if status == 101:
                raise ResponseRefused("a protocol switch (101)")
            out += self.masker.apply(head)
            return True
        if not self.methods:
            raise ResponseRefused("a response to no request")
        method = self.methods.popleft()
        coding = [value.lower() for key, value in headers if key == "content-encoding"]
        if any(value not in ("", "identity") for value in coding):
            raise ResponseRefused(f"a compressed response (Content-Encoding: {coding[0][:40]}) the host cannot "
                                  "read for reflected secrets; it asked for identity")
        out += self.masker.apply(head)
        self._framing(method, status, headers)
        return True

    def _framing(self, method: str, status: int, headers: list[tuple[str, str]]) -> None:
        if method == "HEAD" or status in (204, 304):
            self.state = "head"
            return
        codings = [value.lower() for key, value in headers if key == "transfer-encoding"]
        lengths = {value for key, value in headers if key == "content-length"}
        if codings:
            if codings != ["chunked"]:
                raise ResponseRefused(f"a transfer coding the host cannot read ({codings[0][:40]})")
            self.state = "chunk-size"
        elif lengths:
            (length,) = lengths if len(lengths) == 1 else (None,)
            if length is None or not length.isdigit() or len(length) > 18:
                raise ResponseRefused("a response with an unreadable Content-Length")
            self.left = int(length)
            self.state = "length" if self.left else "head"
        else:
            self.state = "close"  # until the upstream ends it

    def _chunk_size(self, out: bytearray) -> bool:
        end = self.buffer.find(b"\r\n")
        if end < 0:
            if len(self.buffer) > MAX_CHUNK_LINE:
                raise ResponseRefused("a malformed chunked body")
            return False
        size_text = self.buffer[:end].split(b";", 1)[0].strip()
        if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size_text):
            raise ResponseRefused("a malformed chunked body")
        self.buffer = self.buffer[end + 2:]
        self.left = int(size_text, 16)
        if self.left:
            self.state = "chunk-data"
            return True
        held = self.masker.flush()
        if held:
            out += b"%x\r\n" % len(held) + held + b"\r\n"
        out += b"0\r\n"
        self.state = "trailers"
        return True

    def _trailers(self, out: bytearray) -> bool:
        if self.buffer.startswith(b"\r\n"):
            out += b"\r\n"
            self.buffer, self.state = self.buffer[2:], "head"
            return True
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_RESPONSE_HEAD:
                raise ResponseRefused("trailers over the head limit")
            return False
        out += self.masker.apply(self.buffer[:end + 4])
        self.buffer, self.state = self.buffer[end + 4:], "head"
        return True


def _response_head(head: bytes) -> tuple[int, list[tuple[str, str]]]:
    """(status, headers as (lower-case name, value)) of a response head without its blank line."""
    lines = head.split(b"\r\n")
    match = re.fullmatch(rb"HTTP/1\.[01] ([0-9]{3})(?: .*)?", lines[0], re.DOTALL)
    if match is None:
        raise ResponseRefused("a response that is not HTTP/1.x")
    headers = []
    for line in lines[1:]:
        key, colon, value = line.partition(b":")
        if not colon or not HEADER_NAME.fullmatch(key.decode("latin-1")):
            raise ResponseRefused("a malformed response header")
        headers.append((key.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1")))
    return int(match.group(1)), headers
