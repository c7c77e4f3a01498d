"""The egress policy as data: what a guest may reach, independent of YAML and of iptables.

Everything here is immutable and normalised on construction, so two policies that allow the
same thing compare equal and have the same digest, whatever order or grouping their files used.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Collection
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address
from typing import Literal, TypeGuard, Union

from microvm_check.entries import HTTP_METHODS as HTTP_METHODS  # the methods a rule and a record may name

Network = Union[IPv4Network, IPv6Network]
Address = Union[IPv4Address, IPv6Address]
Mode = Literal["block", "audit"]
OnBlock = Literal["warn", "fail"]
Protocol = Literal["tcp", "udp"]

MODES: tuple[str, ...] = ("block", "audit")
ON_BLOCK: tuple[str, ...] = ("warn", "fail")
PROTOCOLS: tuple[str, ...] = ("tcp", "udp")
SUPPORTED_VERSION = 1
# Rule.sort_key: host rules first, then networks by family, address and prefix, then protocol,
# then name-checked before raw (a raw rule and a checked one for the same host stay two rules),
# then the HTTP methods and paths (rules that differ in them are not merged).
SortKey = tuple[int, int, str, bytes, int, str, bool, tuple[str, ...], tuple[str, ...]]
# The methods whose body every server reads. Of any other request (GET, HEAD, OPTIONS, TRACE,
# DELETE, an unknown method, a method in odd case) many servers (Python's http.server, most
# frameworks) leave the body unread on a kept-alive connection, where it is read as the next
# request, one the host never checked: under a `methods:`/`paths:` rule such a request is refused.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Request headers that frameworks read as the request's real method or path (Symfony, Laravel,
# ASP.NET, IIS's URL rewrite, Zend): they would turn an admitted GET into something the rule
# never saw, so a `methods:`/`paths:` rule refuses a request carrying one. Lower-case, `-` for
# `_` (CGI and WSGI map both to one variable).
OVERRIDE_HEADERS = frozenset({"x-http-method-override", "x-http-method", "x-method-override", "x-original-url",
                              "x-rewrite-url"})
# Query parameters frameworks read as the request's real method: `_method` (Rails' Rack::MethodOverride,
# on by default; Symfony and Laravel; Spring's HiddenHttpMethodFilter; Express' method-override) and
# the override headers' names (ASP.NET MVC reads X-HTTP-Method-Override from the query and the form
# too). A key is compared by its letters and digits, lower-cased, after %-decoding (up to three times,
# `+` as a space), so `_METHOD`, `%5Fmethod`, PHP's `.method`, ` method` and `[method` (all `_method`
# in `$_GET`) and `_method[]` are one key; a plain `method` is not (APIs such as Flickr's use it for
# their own purpose). In `Claim.overrides` such a key is spelt `?<key>`.
_OVERRIDE_KEYS = frozenset({"method"} | {name.replace("-", "") for name in OVERRIDE_HEADERS})
_QUERY_SEPARATOR = re.compile(r"[&;]")  # Rack 2 and older Python split a query at `;` too
_ESCAPE_BYTES = re.compile(r"%([0-9A-Fa-f]{2})")
# What a body's Content-Type (lower-cased) contains when some framework could read its fields, and so a
# `_method` among them: forms (`application/x-www-form-urlencoded`, `multipart/form-data`), any
# multipart (Rack parses multipart/mixed and multipart/related) and JSON (Laravel's `isJson` is a
# substring test on `/json` and `+json`, and Laravel reads `_method` from a JSON body).
FORM_TYPE_WORDS = ("form", "multipart", "json")
# What may stand in a path judged by a `paths:` rule: RFC 3986's path characters but `;` (servers
# such as Tomcat, Jetty and Spring drop `;` parameters before they resolve dot segments, so
# `/simple/..;/upload` is `/upload` to them), and %-escapes, read by `_ESCAPE`.
_NOT_PATH_CHAR = re.compile(r"[^A-Za-z0-9._~!$&'()*+,=:@/%-]")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})?")
# Escaped bytes a server could act on: `.` `/` `\` `;` `?` `#`, `%` (decoded twice, `%252e` is a
# dot) and control characters.
_ESCAPED_SPECIALS = frozenset(b"./\\;?#%") | frozenset(range(0x20)) | {0x7F}
# What a decoded (or Unicode-normalised: `\uff0f` is `/` in NFKC) path must not hold.
_SPECIAL = re.compile(r"[\\;?#%\x00-\x1f\x7f]")


def is_mode(value: object) -> TypeGuard[Mode]:
    """Whether `value` names a mode: what turns text read from a file into a `Mode`."""
    return value in MODES


def is_on_block(value: object) -> TypeGuard[OnBlock]:
    """Whether `value` names what a refused egress does to the job (`Policy.on_block`)."""
    return value in ON_BLOCK


def is_protocol(value: object) -> TypeGuard[Protocol]:
    """Whether `value` names a protocol a rule can have: what turns text into a `Protocol`."""
    return value in PROTOCOLS


def as_protocol(value: object) -> Protocol:
    """`value` as a `Protocol`, or ValueError: for callers that hand one over as text (a DNS opening)."""
    if is_protocol(value):
        return value
    raise ValueError(f"protocol must be one of {PROTOCOLS}, got {value!r}")


def network_within(inner: Network, outer: Network) -> bool:
    """Whether `inner` lies inside `outer`; never across IP families (where `subnet_of` raises)."""
    if isinstance(inner, IPv4Network) and isinstance(outer, IPv4Network):
        return inner.subnet_of(outer)
    if isinstance(inner, IPv6Network) and isinstance(outer, IPv6Network):
        return inner.subnet_of(outer)
    return False


def host_matches(pattern: str, name: str) -> bool:
    """Whether a host pattern admits a DNS name.

    An exact pattern admits only itself. `*.example.org` admits every name with at least one more
    label in front (`a.example.org`, `b.a.example.org`), never `example.org` itself: the usual
    meaning for CDN-style sub-domains, and the one that makes wildcard subsumption a plain suffix test.
    """
    name = name.lower().rstrip(".")
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


def path_ambiguity(path: str) -> str | None:
    """Why a server could read `path` (a request's, without the query) as another path than a
    `paths:` glob sees it, or None when none could: the path is judged as the strictest server
    would read it (%-decoded, and Unicode-normalised as some frameworks do), and a path it could
    read two ways is never admitted (`Rule.allows_request`)."""
    if not path.startswith("/"):
        return "it is not a path starting with /"
    odd = _NOT_PATH_CHAR.search(path)
    if odd:
        return f"it has {odd.group()!r} (servers read ; as a parameter, \\ as /, # as a fragment)"
    decoded = bytearray()
    for piece, escape in _pieces(path):
        if escape is None:
            return "it has a % that starts no %-escape"
        if escape and escape[0] in _ESCAPED_SPECIALS:
            return f"it %-escapes {chr(escape[0])!r}, which a server could decode into a path of its own"
        decoded += piece.encode() + escape
    try:
        text = decoded.decode("utf-8")
    except UnicodeDecodeError:
        return "its %-escapes are no valid UTF-8 (an overlong dot or slash among them)"
    return _segments_ambiguity(text) or _segments_ambiguity(unicodedata.normalize("NFKC", text))


def _segments_ambiguity(text: str) -> str | None:
    """Why the decoded path `text` could name another path: a special character, an empty segment,
    or a segment a server could read as . or .. (Windows drops trailing dots and spaces)."""
    odd = _SPECIAL.search(text)
    if odd:
        return f"it decodes to {odd.group()!r}, which a server could read as part of the path's syntax"
    segments = text[1:].split("/")
    if any(not segment for segment in segments[:-1]):
        return "it has an empty segment (//)"
    if any(segment and (segment.startswith("..") or not segment.strip(". ")) for segment in segments):
        return "it has a dot segment (., .., or dots and spaces a server could trim to them)"
    return None


def _pieces(path: str) -> list[tuple[str, bytes | None]]:
    """`path` as (plain text, the byte escaped after it: b"" at the end, None for a bad escape)."""
    found: list[tuple[str, bytes | None]] = []
    at = 0
    for match in _ESCAPE.finditer(path):
        digits = match.group(1)
        found.append((path[at:match.start()], bytes.fromhex(digits) if digits else None))
        at = match.end()
    return [*found, (path[at:], b"")]


def query_overrides(query: str) -> tuple[str, ...]:
    """The keys of a request's query (without the `?`) that frameworks read as the request's method,
    each as `?<key>` as sent (sorted, at most a few): what `Claim.overrides` carries besides headers."""
    found: set[str] = set()
    for field_ in _QUERY_SEPARATOR.split(query):
        key = field_.split("=", 1)[0]
        if not key:
            continue
        decoded = key
        for _ in range(3):
            step = _ESCAPE_BYTES.sub(lambda match: chr(int(match.group(1), 16)), decoded.replace("+", " "))
            if step == decoded:
                break
            decoded = step
        decoded = decoded.lower()
        for spelling in (decoded, decoded.split("[", 1)[0]):  # `[method` is `_method` to PHP; `_method[x]` too
            letters = re.sub(r"[^a-z0-9]", "", spelling)
            if letters in _OVERRIDE_KEYS and spelling.strip() != "method":
                found.add("?" + key[:64])
        if len(found) >= 4:
            break
    return tuple(sorted(found))


def form_type(content_types: Collection[str]) -> bool:
    """Whether a body with these Content-Type header values (every one the request carries) could be
    read as form fields by some framework, and so carry a `_method` field: none (Rack reads a POST
    without one as a form), an empty one, several, or one naming a form, multipart or JSON."""
    if len(content_types) != 1:
        return True
    (value,) = content_types
    value = value.strip().lower()
    return not value or any(word in value for word in FORM_TYPE_WORDS)


def request_doubt(method: str, *, body: bool, overrides: Collection[str]) -> str | None:
    """Why a server could act on an HTTP request otherwise than its method and path say, or None:
    what a `methods:`/`paths:` rule refuses whatever it lists (a `paths:` rule also refuses an
    ambiguous path, `path_ambiguity`; a `methods:` rule a form body, `form_doubt`)."""
    if body and method not in BODY_METHODS:
        return (f"a {method} request with a body (a server that ignores the body would read it as one more "
                "request, which the host never checked)")
    if overrides:
        first = sorted(overrides)[0]
        if first.startswith("?"):
            return f"the query parameter {first[1:]} (frameworks read it as another method)"
        return f"the header {first} (frameworks read it as another method or path)"
    return None


def form_doubt(methods: Collection[str], *, body: bool, form: bool) -> str | None:
    """Why a rule with these `methods` refuses a request whose body could be read as form fields
    (`form_type`), or None: a `_method` field in it is read as the method by Rails, Symfony, Laravel
    and Spring, and it could name any method; the host does not read bodies for it (a body's
    charset, multipart's and JSON's encodings of a field name are too many spellings to judge
    soundly), so only a rule that admits every method (no `methods:`, or all of them) admits one."""
    if not (body and form and methods) or set(HTTP_METHODS) - {"HEAD"} <= set(methods):
        return None
    return ("a form, multipart or JSON body (or one without a Content-Type) under a methods: rule that does not "
            "allow every method: frameworks read a _method field in it as the request's method")


@dataclass(frozen=True)
class Rule:
    """One allowed destination: a host pattern or a network, on some ports of one protocol.

    A TCP host rule is enforced by name (`runner.net.nameproxy`): each connection's TLS SNI or
    HTTP Host must be the name, at an address the resolver handed out for it. `raw` opts a TCP
    host rule out of that (ssh, a database protocol): such a rule is enforced by address only,
    like a `cidr:` rule, and `policy check` says so.
    """

    ports: frozenset[int]
    protocol: Protocol = "tcp"
    host: str | None = None
    network: Network | None = None
    raw: bool = False
    methods: frozenset[str] = frozenset()  # HTTP methods allowed; empty: any (`intercepts`)
    paths: tuple[str, ...] = ()  # globs on the URL path (`*` spans `/` too); empty: any

    def __post_init__(self) -> None:
        if (self.host is None) == (self.network is None):
            raise ValueError("a Rule needs exactly one of host or network")
        if self.raw and (self.host is None or self.protocol != "tcp"):
            raise ValueError("only a tcp host rule can be raw: networks and udp are enforced by address anyway")
        object.__setattr__(self, "methods", frozenset(self.methods))
        object.__setattr__(self, "paths", tuple(sorted(set(self.paths))))
        if (self.methods or self.paths) and not self.name_checked:
            raise ValueError("methods and paths need a name-checked rule (a tcp host rule, not raw)")
        if not self.methods <= set(HTTP_METHODS):
            raise ValueError(f"methods must be among {HTTP_METHODS}, got {sorted(self.methods)}")
        if not all(path.startswith("/") for path in self.paths):
            raise ValueError(f"paths must start with /, got {list(self.paths)}")
        if not self.ports or not all(type(port) is int and 1 <= port <= 65535 for port in self.ports):
            raise ValueError(f"a Rule needs integer ports in 1..65535, got {sorted(self.ports, key=repr)}")
        as_protocol(self.protocol)  # the annotation does not stop an untyped caller
        object.__setattr__(self, "ports", frozenset(self.ports))

    @property
    def destination(self) -> str:
        return self.host if self.host is not None else str(self.network)

    def allows(self, port: int, protocol: str, *, name: str | None = None,
               address: Address | str | None = None) -> bool:
        """Whether this rule admits a connection; a host rule looks at the name the resolver
        handed out, a network rule at the address actually dialled."""
        if port not in self.ports or protocol != self.protocol:
            return False
        if self.host is not None:
            return name is not None and host_matches(self.host, name)
        network = self.network  # not None: a rule without a host has a network
        if address is None or network is None:
            return False
        address = ip_address(address)
        return address.version == network.version and address in network

    def matches_host(self, name: str) -> bool:
        """Whether this is a host rule whose pattern admits `name`."""
        return self.host is not None and host_matches(self.host, name)

    @property
    def name_checked(self) -> bool:
        """Whether connections under this rule are checked by name (a TCP host rule, not raw)."""
        return self.host is not None and self.protocol == "tcp" and not self.raw

    @property
    def intercepts(self) -> bool:
        """Whether its requests are checked one by one (methods or paths), which HTTPS needs the
        host to terminate TLS for (`runner.net.jobca`); without them only the name is checked."""
        return bool(self.methods or self.paths)

    def allows_request(self, method: str, path: str, *, body: bool = False, overrides: Collection[str] = (),
                       form: bool = False) -> bool:
        """Whether one HTTP request passes this rule: its method (compared as sent: methods are
        case-sensitive), its path (without the query), whether its head announces a body and whether
        that body could be read as form fields (`form_type`), and the `OVERRIDE_HEADERS` and
        `query_overrides` it carries. A rule without methods or paths admits any request."""
        if not self.intercepts:
            return True
        if request_doubt(method, body=body, overrides=overrides) is not None:
            return False
        if form_doubt(self.methods, body=body, form=form) is not None:
            return False
        if self.methods and method not in self.methods and not (method == "HEAD" and "GET" in self.methods):
            return False
        if not self.paths:
            return True
        return path_ambiguity(path) is None and any(fnmatchcase(path, glob) for glob in self.paths)

    def in_family(self, version: int) -> bool:
        """Whether this is a network rule of IP version `version` (4 or 6); a host rule is in neither."""
        return self.network is not None and self.network.version == version

    def canonical(self) -> dict[str, object]:
        kind = "host" if self.host is not None else "cidr"
        canonical: dict[str, object] = {kind: self.destination, "ports": sorted(self.ports), "protocol": self.protocol}
        if self.raw:  # only when set: the digests of policies without raw rules stay what they were
            canonical["raw"] = True
        if self.methods:
            canonical["methods"] = sorted(self.methods)
        if self.paths:
            canonical["paths"] = list(self.paths)
        return canonical

    def sort_key(self) -> SortKey:
        network = self.network
        if network is None:
            return (0, 0, self.destination, b"", 0, self.protocol, self.raw, tuple(sorted(self.methods)), self.paths)
        return (1, network.version, "", network.network_address.packed, network.prefixlen,
                self.protocol, self.raw, (), ())


def _normalise(rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """Merge rules for the same destination and protocol and sort them, so equal meaning gives
    equal objects and equal digests."""
    merged: dict[SortKey, Rule] = {}
    for rule in rules:
        key = rule.sort_key()
        if key in merged:
            rule = Rule(merged[key].ports | rule.ports, rule.protocol, rule.host, rule.network, rule.raw,
                        rule.methods, rule.paths)
        merged[key] = rule
    return tuple(merged[key] for key in sorted(merged))


@dataclass(frozen=True)
class Policy:
    """What a job's guest may reach. `mode="audit"` lets everything through but records what
    `block` would have stopped; the rules still say what is meant to be allowed. `on_block="fail"`
    fails a job whose guest had egress refused (the default "warn" only lists it)."""

    version: int = SUPPORTED_VERSION
    mode: Mode = "block"
    rules: tuple[Rule, ...] = field(default=())
    on_block: OnBlock = "warn"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.on_block not in ON_BLOCK:
            raise ValueError(f"on_block must be one of {ON_BLOCK}, got {self.on_block!r}")
        object.__setattr__(self, "rules", _normalise(tuple(self.rules)))

    @property
    def host_rules(self) -> tuple[Rule, ...]:
        return tuple(rule for rule in self.rules if rule.host is not None)

    @property
    def network_rules(self) -> tuple[Rule, ...]:
        return tuple(rule for rule in self.rules if rule.network is not None)

    @property
    def intercepted_hosts(self) -> tuple[str, ...]:
        """The host patterns of the rules with methods or paths: the names whose HTTPS the host may
        terminate, and so all a job's CA may vouch for (`runner.net.jobca`); empty: no CA is needed."""
        return tuple(sorted({rule.host for rule in self.rules if rule.intercepts and rule.host is not None}))

    def rules_for_host(self, name: str) -> tuple[Rule, ...]:
        """The host rules a DNS answer for `name` falls under: what the resolver asks before it
        adds the answer's addresses to the VM's allow chain (see `policy.render.dns_allow_rule`)."""
        return tuple(rule for rule in self.rules if rule.matches_host(name))

    def allows(self, port: int, protocol: str, *, name: str | None = None,
               address: Address | str | None = None) -> bool:
        """Whether the rules admit a connection, ignoring mode (audit lets everything through)."""
        return any(rule.allows(port, protocol, name=name, address=address) for rule in self.rules)

    def canonical(self) -> dict[str, object]:
        canonical: dict[str, object] = {"version": self.version, "mode": self.mode,
                                        "allow": [rule.canonical() for rule in self.rules]}
        if self.on_block != "warn":  # only when set: earlier policies keep their digests
            canonical["on_block"] = self.on_block
        return canonical

    def digest(self) -> str:
        """`sha256:<hex>` of the canonical JSON form: stable across runs, file layout and rule
        order, so a job record names exactly the egress its VM had."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


DENY_ALL = Policy(version=SUPPORTED_VERSION, mode="block", rules=())
