"""The policy an audit run suggests: block-mode YAML that allows exactly what the job tried.

It lives with the policy, not with the network code that collects the records (`runner.net.audit`
reads them from NFLOG, which needs netlink and root): the action renders the suggestion from a job
record's `blocked_egress` entries and must not import that. `merged_policy` does the same for many
jobs of one repository (`microvm-check policy suggest`): audit runs over weeks, matrix shards and
branches each need a little, and the operator wants one policy that lets all of them pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import yaml

from microvm_check.entries import (
    ALWAYS_DENIED,
    BLOCK_LISTED,
    BLOCK_LISTED_DEST,
    INTERNAL_ADDRESS,
    NAME_REFUSED,
    POLICY,
    REFUSED_DEST,
    REFUSED_NAME,
    REFUSED_NAME_DEST,
    REQUEST_REFUSED,
    SECRET_REFUSED,
    UNNAMED,
    UPSTREAM_UNTRUSTED,
    AuditRecord,
    path_prefix,
)

# The record and its vocabulary live in microvm_check.entries (the SDK reads them too, and may not import
# policy); the network code that writes records names them here, beside the suggestion that reads them.
__all__ = [
    "ALWAYS_DENIED", "BLOCK_LISTED", "BLOCK_LISTED_DEST", "INTERNAL_ADDRESS", "MAX_LISTED", "NAME_REFUSED", "POLICY",
    "REFUSED_DEST", "REFUSED_IN_EVERY_MODE", "REFUSED_NAME", "REFUSED_NAME_DEST", "REQUEST_REFUSED", "SECRET_REFUSED",
    "UNNAMED", "UPSTREAM_UNTRUSTED", "AuditRecord", "JobAudit", "admitted", "merged_policy", "narrowed_words", "path_prefix",
    "refused", "refused_name_record", "refused_summary", "suggest_policy", "utc_minute",
]


# What audit mode refuses too (the rest it lets through and only records).
REFUSED_IN_EVERY_MODE = (ALWAYS_DENIED, INTERNAL_ADDRESS, BLOCK_LISTED, SECRET_REFUSED)
MAX_LISTED = 10  # refused entries named in an on_block: fail message; the rest are counted


def refused(records: Iterable[AuditRecord], mode: str) -> list[AuditRecord]:
    """The records of egress the guest actually had refused: all of them in block mode, only what
    no mode lets through in audit mode (what `on_block: fail` fails a job for)."""
    return [record for record in records if mode == "block" or record.reason in REFUSED_IN_EVERY_MODE]


def refused_summary(records: list[AuditRecord]) -> str:
    """One line naming the refused egress (name or address, port, why), for the job's error."""
    parts = [f"{record.proto} {record.name or record.dest}{f':{record.port}' if record.port else ''} ({record.reason})"
             for record in records[:MAX_LISTED]]
    more = f" and {len(records) - MAX_LISTED} more" if len(records) > MAX_LISTED else ""
    return ", ".join(parts) + more


MAX_NARROWED = 20  # entries of a narrowed job policy named in words; the rest are "and more"


def narrowed_words(narrowed: object) -> str | None:
    """In words, what the job's own policy asked for that the repository's allows nothing of (the
    record's `narrowed_egress`, as `policy.compose.narrowed_away` wrote it), or None: the step summary's
    and the job page's."""
    if not isinstance(narrowed, list) or not narrowed:
        return None
    asked = ", ".join(str(item) for item in narrowed[:MAX_NARROWED]) + (" and more" if len(narrowed) > MAX_NARROWED else "")
    return (f"The job's policy asked for {asked}, but the repository's policy allows none of it, so the job ran "
            "without that egress (a job's policy can only narrow the repository's); ask the repository's "
            "maintainers to allow it there, if the job needs it.")


def refused_name_record(name: str, count: int) -> AuditRecord:
    """The record of a name the resolver refused `count` times because no rule of the policy names it."""
    return AuditRecord(dest=REFUSED_NAME_DEST, port=None, proto="dns", name=name, count=count, reason=REFUSED_NAME)


def admitted(record: AuditRecord) -> AuditRecord | None:
    """The record as a suggestion (or a metric's label) may use it: its name only when the policy loader
    accepts it, so a suggestion always loads and no text of the guest's choosing lands in it; a DNS
    record, which names nothing but its name, is left out without one."""
    if record.name is None or _policy_host(record.name):
        return record
    if record.proto == "dns":
        return None
    return replace(record, name=None)


def _policy_host(name: str) -> bool:
    """Whether `name` is a host the policy loader accepts: the one rule, so a suggestion always loads.

    A resolver name has no wildcard, so `*` (which host_error allows as a leading `*.`) is refused.
    """
    from policy.load import host_error  # policy.load is heavier; the action's import test counts modules

    return "*" not in name and host_error(name) is None


def _admitted(records: Iterable[AuditRecord]) -> list[AuditRecord]:
    return [record for record in map(admitted, records) if record is not None]


_Target = tuple[str, str, str, bool]  # ("host" or "cidr", its value, protocol, raw)


def _classify(record: AuditRecord) -> tuple[_Target, int] | str:
    """Where a record goes in a suggestion: a rule target and port, or a comment's text (without "# ")."""
    if record.reason == ALWAYS_DENIED:
        return f"always denied, no policy can allow it, was attempted: {_attempt(record)}"
    if record.reason == BLOCK_LISTED:
        return f"on the operator's block list, refused in every mode, was attempted: {record.name or _attempt(record)}"
    if record.reason == INTERNAL_ADDRESS and record.proto == "dns":
        return (f"{record.name} resolved to an internal address, refused; a cidr: rule inside "
                f"its range allows it, if it is meant to be reached")
    if record.reason == INTERNAL_ADDRESS:
        return (f"an internal address, refused in every mode, was attempted: {_attempt(record)}; "
                f"a cidr: rule inside its range allows it, if it is meant to be reached")
    if record.reason == REFUSED_NAME:
        return (f"{record.name} was looked up and refused (no rule names it), so no port was tried; "
                f"add it with the ports it needs, if it is meant to be reached")
    if record.reason == NAME_REFUSED:
        return (f"tcp to {record.dest} port {record.port} named {record.name}, which the resolver did not hand "
                f"that address out for; a host: rule for {record.name} allows it once the job looks the name up")
    if record.reason == REQUEST_REFUSED:
        return (f"{record.method} {record.path} on {record.name} (tcp port {record.port}) was refused by the rule's "
                f"methods/paths; add {record.method} or a path glob covering {record.path} to it, if it is meant")
    if record.reason == SECRET_REFUSED:
        return (f"the placeholder of secret {record.binding or '?'} was sent where its binding does not let it go "
                f"({_attempt(record)}{f', {record.name}' if record.name else ''}); refused in every mode")
    if record.reason == UPSTREAM_UNTRUSTED:
        return f"{record.name} (tcp port {record.port}) presented a certificate the runner host does not trust"
    if record.unnamed and record.name and record.port is not None and record.reason == POLICY:
        return ("host", record.name, "tcp", True), record.port  # only raw: true admits what names nothing
    if record.reason == UNNAMED:
        return (f"tcp to {record.dest} port {record.port} named nothing checkable (no TLS SNI or HTTP Host, or an "
                f"encrypted ClientHello); a raw: true entry would allow it by address, if that is meant")
    if record.port is None or record.proto not in ("tcp", "udp"):
        return f"not expressible in a policy, was attempted: {record.proto} to {record.name or record.dest}"
    if record.name:
        return ("host", record.name, record.proto, False), record.port
    bits = 128 if ":" in record.dest else 32
    return ("cidr", f"{record.dest}/{bits}", record.proto, False), record.port


def _request(record: AuditRecord) -> tuple[str, int, str, str] | None:
    """(host, port, method, path glob) of an HTTP request a `methods:`/`paths:` rule refused: what a
    suggestion adds as an entry of its own (beside the audited rule, it admits those requests too)."""
    if record.reason != REQUEST_REFUSED or record.name is None or record.port is None:
        return None
    if record.method is None or record.path is None:
        return None
    return record.name, record.port, record.method, record.path


def _entry(target: _Target, ports: set[int]) -> dict[str, object]:
    kind, value, proto, raw = target
    entry: dict[str, object] = {kind: value, "ports": sorted(ports)}
    if proto != "tcp":
        entry["protocol"] = proto
    if raw:
        entry["raw"] = True
    return entry


def _raw_warning(target: _Target, ports: set[int]) -> str:
    """The comment beside a suggested `raw: true` entry: why it is raw, and what that costs."""
    return (f"{target[1]} ports {','.join(map(str, sorted(ports)))}: the job's connections there named nothing the host "
            "can check (no TLS SNI or HTTP Host, or the server spoke first), so the entry is raw: enforced by "
            "address only, any name served at the addresses it resolves to is reachable on those ports")


def suggest_policy(records: Iterable[AuditRecord]) -> str:
    """A block-mode policy YAML that allows exactly what the audited job tried.

    Destinations the resolver handed out are allowed by name (addresses behind a name change);
    others by their single address. Port-less protocols (ICMP) cannot be expressed in the policy
    and always-denied destinations cannot be allowed by one: both are listed as comments instead,
    as are internal addresses, dialled or refused by the resolver (allowing one is a decision, not
    a suggestion, and a host rule never could), and names refused in block mode (no port is known).
    """
    by_target: dict[_Target, set[int]] = {}
    comments: set[str] = set()
    requests: dict[tuple[str, int], tuple[set[str], set[str]]] = {}
    for record in _admitted(records):
        request = _request(record)
        if request is not None:
            methods, paths = requests.setdefault(request[:2], (set(), set()))
            methods.add(request[2])
            paths.add(request[3])
            continue
        where = _classify(record)
        if isinstance(where, str):
            comments.add(f"# {where}\n")
        else:
            by_target.setdefault(where[0], set()).add(where[1])
    allow = [_entry(target, ports) for target, ports in sorted(by_target.items())]
    allow += [_request_entry(host, port, methods, paths) for (host, port), (methods, paths) in sorted(requests.items())]
    comments |= {f"# warning: {_raw_warning(target, ports)}\n" for target, ports in by_target.items() if target[3]}
    text = yaml.safe_dump({"version": 1, "mode": "block", "allow": allow}, sort_keys=False)
    return text + "".join(sorted(comments))


def _request_entry(host: str, port: int, methods: set[str], paths: set[str]) -> dict[str, object]:
    return {"host": host, "ports": [port], "methods": sorted(methods), "paths": sorted(paths)}


def _attempt(record: AuditRecord) -> str:
    port = f" port {record.port}" if record.port is not None else ""
    return f"{record.proto} to {record.dest}{port}"


# -- many jobs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobAudit:
    """One job's records and when it ran: what `merged_policy` reads from the service's job records."""

    job_id: str
    at: float  # when the job was submitted (seconds since the epoch)
    records: tuple[AuditRecord, ...]


@dataclass
class _Seen:
    """How often and when a rule's or a comment's attempts were seen across jobs."""

    jobs: set[str] = field(default_factory=set)
    attempts: int = 0
    first: float = float("inf")
    last: float = float("-inf")

    def add(self, job: JobAudit, count: int) -> None:
        self.jobs.add(job.job_id)
        self.attempts += count
        self.first, self.last = min(self.first, job.at), max(self.last, job.at)

    def describe(self, total: int) -> str:
        return (f"seen in {len(self.jobs)} of {total} jobs, {self.attempts} attempts, "
                f"first {utc_minute(self.first)}, last {utc_minute(self.last)}")


def merged_policy(jobs: Iterable[JobAudit], header: str = "") -> str:
    """One block-mode policy YAML that allows what every one of `jobs` tried, each rule preceded by a
    comment saying in how many jobs, how often and when it was seen (requests a `methods:`/`paths:`
    rule refused become an entry with those methods and paths, as in `suggest_policy`; connections
    that named nothing a `raw: true` entry with its warning); what no policy can or should
    allow (always-denied, internal, refused names, ICMP) is listed as comments after it, never allowed.
    `header` (one comment line per line of text) says where the suggestion came from."""
    jobs = list(jobs)
    ports: dict[_Target, set[int]] = {}
    seen: dict[_Target, _Seen] = {}
    notes: dict[str, _Seen] = {}
    requests: dict[tuple[str, int], tuple[set[str], set[str], _Seen]] = {}
    for job in jobs:
        for record in _admitted(job.records):
            request = _request(record)
            if request is not None:
                methods, paths, request_seen = requests.setdefault(request[:2], (set(), set(), _Seen()))
                methods.add(request[2])
                paths.add(request[3])
                request_seen.add(job, record.count)
                continue
            where = _classify(record)
            if isinstance(where, str):
                notes.setdefault(where, _Seen()).add(job, record.count)
                continue
            target, port = where
            ports.setdefault(target, set()).add(port)
            seen.setdefault(target, _Seen()).add(job, record.count)
    lines = [f"# {line}" for line in header.splitlines()]
    lines += ["version: 1", "mode: block", "allow:" if ports or requests else "allow: []"]
    entries = [(seen[target], _entry(target, ports[target]), _raw_warning(target, ports[target]) if target[3] else "")
               for target in sorted(ports)]
    entries += [(request_seen, _request_entry(host, port, methods, paths), "")
                for (host, port), (methods, paths, request_seen) in sorted(requests.items())]
    for entry_seen, entry, warning in entries:
        lines.append(f"  # {entry_seen.describe(len(jobs))}")
        if warning:
            lines.append(f"  # warning: {warning}")
        rule = yaml.safe_dump([entry], sort_keys=False, default_flow_style=None)
        lines += [f"  {line}" for line in rule.splitlines()]
    for text in sorted(notes):
        lines.append(f"# {text} ({notes[text].describe(len(jobs))})")
    return "\n".join(lines) + "\n"


def utc_minute(epoch: float) -> str:
    """A time in comments and messages: to the minute, in UTC, so that hosts in any zone agree."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))
