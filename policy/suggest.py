"""The policy an audit run suggests: block-mode YAML that allows exactly what the job tried.

It lives with the policy, not with the network code that collects the records (`runner.net.audit`
reads them from NFLOG, which needs netlink and root): the action renders the suggestion from a job
record's `blocked_egress` entries and must not import that.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

POLICY = "policy"  # blocked because the policy does not allow it (or, in audit mode, would block it)
ALWAYS_DENIED = "always-denied"  # the host, the metadata service, loopback: no policy can allow it
# An internal address (private, CGNAT, ULA, ...) that no `cidr:` rule opts into (`policy.reserved.opted_in`),
# refused in every mode: dialled directly (the record has the address the guest dialled), or handed to
# the resolver as an allowed name's answer (proto "dns", no port, and no address: see
# `runner.net.audit.refused_answer_record`).
INTERNAL_ADDRESS = "internal-address"
# What a refused answer's record shows instead of the address: the guest never got it, and the record
# reaches the public job summary (a fork could point an allowed name at an internal name through a
# CNAME and read a split-horizon resolver's private answer there). The service log keeps the address.
REFUSED_DEST = "internal address refused"


@dataclass(frozen=True)
class AuditRecord:
    """One blocked (or, in audit mode, would-be-blocked) destination and how often the guest tried it."""

    dest: str  # the address dialled, or REFUSED_DEST
    port: int | None
    proto: str
    name: str | None
    count: int
    reason: str = POLICY

    def as_json(self) -> dict[str, object]:
        return {"dest": self.dest, "port": self.port, "proto": self.proto, "name": self.name, "count": self.count,
                "reason": self.reason}


def suggest_policy(records: list[AuditRecord]) -> str:
    """A block-mode policy YAML that allows exactly what the audited job tried.

    Destinations the resolver handed out are allowed by name (addresses behind a name change);
    others by their single address. Port-less protocols (ICMP) cannot be expressed in the policy
    and always-denied destinations cannot be allowed by one: both are listed as comments instead,
    as are internal addresses, dialled or refused by the resolver (allowing one is a decision, not
    a suggestion, and a host rule never could).
    """
    by_target: dict[tuple[str, str, str], set[int]] = {}
    comments: set[str] = set()
    for record in records:
        if record.reason == ALWAYS_DENIED:
            comments.add(f"# always denied, no policy can allow it, was attempted: {_attempt(record)}\n")
            continue
        if record.reason == INTERNAL_ADDRESS and record.proto == "dns":
            comments.add(f"# {record.name} resolved to an internal address, refused; a cidr: rule inside "
                         f"its range allows it, if it is meant to be reached\n")
            continue
        if record.reason == INTERNAL_ADDRESS:
            comments.add(f"# an internal address, refused in every mode, was attempted: {_attempt(record)}; "
                         f"a cidr: rule inside its range allows it, if it is meant to be reached\n")
            continue
        if record.port is None or record.proto not in ("tcp", "udp"):
            comments.add(f"# not expressible in a policy, was attempted: {record.proto} to {record.name or record.dest}\n")
            continue
        if record.name:
            target = ("host", record.name, record.proto)
        else:
            bits = 128 if ":" in record.dest else 32
            target = ("cidr", f"{record.dest}/{bits}", record.proto)
        by_target.setdefault(target, set()).add(record.port)
    allow = []
    for (kind, value, proto), ports in sorted(by_target.items()):
        entry: dict[str, object] = {kind: value, "ports": sorted(ports)}
        if proto != "tcp":
            entry["protocol"] = proto
        allow.append(entry)
    text = yaml.safe_dump({"version": 1, "mode": "block", "allow": allow}, sort_keys=False)
    return text + "".join(sorted(comments))


def _attempt(record: AuditRecord) -> str:
    port = f" port {record.port}" if record.port is not None else ""
    return f"{record.proto} to {record.dest}{port}"
