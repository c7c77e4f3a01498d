"""The entries of a job's record that its guest decided: the egress its policy refused (`AuditRecord`,
a record's and an exec's `blocked_egress`) and the files it handed back (`Artifact`, a record's
`artifacts`). One type each, from the service's audit to the action, the page, the check run, policy
suggestion and this SDK (docs/job-api.md, docs/sdk.md).

Their values derive from the guest's traffic and files, so `from_wire` is where they enter a reader: it
keeps only what the rules below allow (an address, a port in range, a known protocol and reason, a name
within bounds, an HTTP method and a path prefix of plain characters, a relative artifact path) and answers
None for an entry that breaks them. The service applies the same rules to what its audit saw
(`AuditRecord.checked`) before the entry reaches a record. Text (a name the guest looked up or claimed)
is escaped wherever it is shown, and a policy suggestion takes only a name a policy loads
(`policy.suggest.admitted`).

It imports nothing but the standard library: the SDK must not import the service, and the service,
the policy and the action import it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

POLICY = "policy"  # blocked because the policy does not allow it (or, in audit mode, would block it)
ALWAYS_DENIED = "always-denied"  # the host, the metadata service, loopback: no policy can allow it
# An internal address (private, CGNAT, ULA, ...) that no `cidr:` rule opts into (`policy.reserved.opted_in`),
# refused in every mode: dialled directly (the record has the address the guest dialled), or handed to
# the resolver as an allowed name's answer (proto "dns", no port, and no address: see
# `runner.net.audit.refused_answer_record`).
INTERNAL_ADDRESS = "internal-address"
# A name the policy has no rule for, looked up by the guest: in block mode the resolver answered NXDOMAIN,
# so no address (and no port) was ever tried; without this record such a job's egress table would be empty.
REFUSED_NAME = "refused-name"
# A TCP connection under a name-checked host rule whose TLS SNI or HTTP Host (the record's name) is
# not a name the policy allows there, or was not handed out by the resolver for the address dialled.
NAME_REFUSED = "name-refused"
# A TCP connection under a name-checked host rule that named nothing the host can check: neither TLS
# nor HTTP, no SNI, an encrypted ClientHello (the record's name is then its outer SNI, if any), a
# malformed or smuggling-shaped request, or no first flight in time.
UNNAMED = "unnamed"
# On the operator's block list (`policy.blocklist`): refused in every mode, and never suggested.
BLOCK_LISTED = "block-listed"
# An HTTP request under a `methods:`/`paths:` rule whose method or path it does not allow (the
# record's `method` and `path`, a prefix of the path: the rest may carry secrets of the job's).
REQUEST_REFUSED = "request-refused"
# The host terminated TLS for a `methods:`/`paths:` rule and the upstream's certificate failed
# verification against the host's trust store: the guest got a 502 saying so.
UPSTREAM_UNTRUSTED = "upstream-untrusted"
# A secret's placeholder (`runner.net.secretswap`) where its binding does not let it go: another host,
# port, method or path, a body, a query, another header, a TLS server name or a DNS name. The record
# names the binding (`binding`), never a value; refused in every mode, never suggested.
SECRET_REFUSED = "secret-refused"
REASONS = (POLICY, ALWAYS_DENIED, INTERNAL_ADDRESS, REFUSED_NAME, NAME_REFUSED, UNNAMED, BLOCK_LISTED,
           REQUEST_REFUSED, UPSTREAM_UNTRUSTED, SECRET_REFUSED)

# What a refused answer's record shows instead of the address: the guest never got it, and the record
# reaches the public job summary (a fork could point an allowed name at an internal name through a
# CNAME and read a split-horizon resolver's private answer there). The service log keeps the address.
REFUSED_DEST = "internal address refused"
REFUSED_NAME_DEST = "name refused"  # a refused name's record: the resolver gave it no address
BLOCK_LISTED_DEST = "name block-listed"  # a block-listed name's record: the resolver gave it no address
_DNS_DESTS = {INTERNAL_ADDRESS: REFUSED_DEST, REFUSED_NAME: REFUSED_NAME_DEST, BLOCK_LISTED: BLOCK_LISTED_DEST}

PROTOCOLS = ("tcp", "udp", "icmp", "icmpv6")
HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
MAX_COUNT = 10**9  # a record's count comes from guest traffic: kept in a range a sum cannot overflow into nonsense
MAX_PATH = 4096  # Linux's PATH_MAX: an artifact's path
MAX_NAME = 255  # a DNS name on the wire; a TLS SNI or HTTP Host the guest claimed is held to it too
_BINDING = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")  # runner.net.secretswap.NAME
_PREFIX_SEGMENT = re.compile(r"[A-Za-z0-9._~-]{1,64}")


def path_prefix(path: str) -> str:
    """What a record keeps of a request path: its first segment as a glob (`/simple/*`), or `/`;
    only plain characters, so a path the guest chose cannot put markup or secrets in a summary."""
    first = path.split("?", 1)[0].lstrip("/").split("/", 1)
    if not first[0]:
        return "/"
    if not _PREFIX_SEGMENT.fullmatch(first[0]) or first[0] in (".", ".."):
        return "/*"
    return f"/{first[0]}" + ("/*" if len(first) > 1 else "")


@dataclass(frozen=True)
class AuditRecord:
    """One blocked (or, in audit mode, would-be-blocked) destination and how often the guest tried it."""

    dest: str  # the address dialled, or REFUSED_DEST, REFUSED_NAME_DEST, BLOCK_LISTED_DEST (no address given)
    port: int | None  # None for ICMP and for DNS records: no port was tried
    proto: str  # PROTOCOLS, or "dns"
    name: str | None
    count: int
    reason: str = POLICY
    method: str | None = None  # an HTTP request's (name-checked rules), else None
    path: str | None = None  # `path_prefix` of its path
    # A TCP connection the name check saw name nothing (no TLS SNI or HTTP Host; the server spoke
    # first): only a `raw: true` entry admits it. Audit mode records one that no rule covers with
    # reason POLICY and `name` the name the resolver handed the address out for (what a suggested
    # raw entry needs); under a name-checked rule the reason is UNNAMED and `name` what it claimed.
    unnamed: bool = False
    binding: str | None = None  # SECRET_REFUSED: the binding whose placeholder it was

    def to_wire(self) -> dict[str, object]:
        """The entry as JSON: method and path only for a request, unnamed only when true, binding only when named."""
        found: dict[str, object] = {"dest": self.dest, "port": self.port, "proto": self.proto, "name": self.name,
                                    "count": self.count, "reason": self.reason}
        if self.method is not None:
            found["method"], found["path"] = self.method, self.path
        if self.unnamed:
            found["unnamed"] = True
        if self.binding is not None:
            found["binding"] = self.binding
        return found

    @classmethod
    def from_wire(cls, item: object) -> AuditRecord | None:
        """The entry, or None when it is not one a reader may trust (see the module's rules). An unknown
        reason is read as POLICY, a name out of bounds as none, a count out of range as 1."""
        if not isinstance(item, Mapping):
            return None
        reason = item.get("reason")
        reason = reason if isinstance(reason, str) and reason in REASONS else POLICY
        count = item.get("count")
        count = count if isinstance(count, int) and not isinstance(count, bool) and 0 < count <= MAX_COUNT else 1
        name = _name(item.get("name"))
        binding = item.get("binding")
        binding = binding if isinstance(binding, str) and _BINDING.fullmatch(binding) else None
        if item.get("proto") == "dns":
            return _dns(name, count, reason, binding)
        return _dialled(item, name, count, reason, binding)

    def checked(self) -> AuditRecord | None:
        """This record as a reader will read it (`from_wire`'s rules): the service's audit builds records
        from the guest's traffic, and holds them to the rules before they reach a job's record."""
        return self.from_wire(self.to_wire())


def _name(name: object) -> str | None:
    """A record's name: text within MAX_NAME, else none. It is what the guest looked up or claimed (a TLS
    SNI, an HTTP Host), so it is shown escaped; `policy.suggest.admitted` decides whether a policy may name it."""
    return name if isinstance(name, str) and 0 < len(name) <= MAX_NAME else None


def _dns(name: str | None, count: int, reason: str, binding: str | None) -> AuditRecord | None:
    """A DNS record: a refused answer, name or block-listed name, or a secret's placeholder in a name
    (which is not shown); no address was handed out, so none is shown."""
    if reason == SECRET_REFUSED:
        return AuditRecord(REFUSED_NAME_DEST, None, "dns", None, count, reason, binding=binding)
    if name is None or reason not in _DNS_DESTS:
        return None
    return AuditRecord(_DNS_DESTS[reason], None, "dns", name, count, reason)


def _dialled(item: Mapping[str, object], name: str | None, count: int, reason: str,
             binding: str | None) -> AuditRecord | None:
    """A record of an address the guest dialled: its address, port and protocol must be well formed."""
    given_dest, port, proto = item.get("dest"), item.get("port"), item.get("proto")
    if not isinstance(given_dest, (str, int)) or isinstance(given_dest, bool):
        return None
    try:
        dest = str(ipaddress.ip_address(given_dest))
    except ValueError:
        return None
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        return None
    if not isinstance(proto, str) or proto not in PROTOCOLS or reason == REFUSED_NAME:
        return None
    method, path = item.get("method"), item.get("path")
    method = method if isinstance(method, str) and method in HTTP_METHODS else None
    path = path if method is not None and isinstance(path, str) and path_prefix(path) == path else None
    unnamed = item.get("unnamed") is True and proto == "tcp"
    return AuditRecord(dest, port, proto, name, count, reason, method, path, unnamed,
                       binding if reason == SECRET_REFUSED else None)


@dataclass(frozen=True)
class Artifact:
    """One file of a job's artifacts as the service validated it into their clean tar: its path there
    (relative, `/`-separated, no `..`) and its size in bytes."""

    path: str
    size: int

    def to_wire(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size}

    @classmethod
    def from_wire(cls, item: object) -> Artifact | None:
        """The entry, or None when its path is not a relative path of text or its size not a count of bytes."""
        if not isinstance(item, Mapping):
            return None
        path, size = item.get("path"), item.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        if not isinstance(path, str) or not 0 < len(path) <= MAX_PATH or "\0" in path or path.startswith("/"):
            return None
        if ".." in path.split("/"):
            return None
        return cls(path, size)
