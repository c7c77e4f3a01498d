"""Combining policies: the effective policy of a job is the intersection of every layer.

Layers are the org default, the repository's file (both from the operator's trusted store) and
optionally the job's own policy. Intersection, never union, is what keeps a pull request from
widening its own egress: whatever a job brings, the result allows no connection that any layer
forbids.

Precisely, for policies A and B, `intersect(A, B)` holds the pairwise intersection of their rules:

- destinations:
  - two host patterns: equal names give that name; an exact name and a wildcard that matches it
    give the exact name; two wildcards give the narrower one when one lies under the other
    (`*.files.example.org` under `*.example.org`), and nothing otherwise;
  - two networks: they overlap only when one contains the other, and give the smaller one;
    an IPv4 and an IPv6 network never overlap;
  - a host pattern and a network give *nothing*. "Name matches and address lies in the network"
    cannot be expressed as one rule; dropping the pair keeps the result narrower than both sides,
    which is the safe side. Write both layers in the same terms when they must combine.
- protocols must be equal; ports are the set intersection and must not be empty.
- a host rule is `raw` (enforced by address, not by name) only when both sides are; `methods`
  and `paths` intersect (a side without them allows any); paths keep only the globs both list.
- mode: block if either side is block, audit only when both are. A job asking for audit on a
  block policy therefore still gets block.
- on_block: fail if either side says fail (the stricter), warn only when both do.

The result is never wider than either side, for every connection (see the property tests).
"""

from __future__ import annotations

from functools import reduce

from policy.model import Mode, Network, OnBlock, Policy, Rule, host_matches, network_within


def intersect(first: Policy, *others: Policy) -> Policy:
    """The policy allowing exactly what every given policy's rules allow (see the module doc)."""
    return reduce(_intersect_two, others, first)


def _intersect_two(a: Policy, b: Policy) -> Policy:
    rules = [rule for left in a.rules for right in b.rules
             if (rule := intersect_rules(left, right)) is not None]
    mode: Mode = "audit" if a.mode == b.mode == "audit" else "block"
    on_block: OnBlock = "fail" if "fail" in (a.on_block, b.on_block) else "warn"
    return Policy(version=a.version, mode=mode, rules=tuple(rules), on_block=on_block)


def narrowed_away(requested: Policy, effective: Policy) -> list[str]:
    """The entries of `requested` (a job's own policy) of which `effective` (its intersection with
    the repository's) allows nothing, in words (`pypi.org tcp/443`): what the job asked for and
    will not get, for its summary and page. Every effective rule stems from a requested one and
    intersects it, so a requested rule that meets none of them was dropped whole."""
    return [_describe(rule) for rule in requested.rules
            if not any(intersect_rules(rule, kept) is not None for kept in effective.rules)]


def _describe(rule: Rule) -> str:
    ports = sorted(rule.ports)
    listed = ",".join(map(str, ports[:8])) + (f" and {len(ports) - 8} more" if len(ports) > 8 else "")
    return f"{rule.destination} {rule.protocol}/{listed}"


def intersect_rules(a: Rule, b: Rule) -> Rule | None:
    """The rule allowing what both rules allow, or None when they share nothing."""
    if a.protocol != b.protocol:
        return None
    ports = a.ports & b.ports
    if not ports:
        return None
    if a.host is not None and b.host is not None:
        host = intersect_hosts(a.host, b.host)
        # raw (enforced by address) only when both sides say so: otherwise the name check stays
        raw = a.raw and b.raw
        methods, paths = _requests(a, b)
        if host is None or methods is None or paths is None or (raw and (methods or paths)):
            return None
        return Rule(ports=ports, protocol=a.protocol, host=host, raw=raw, methods=methods, paths=paths)
    if a.network is not None and b.network is not None:
        network = intersect_networks(a.network, b.network)
        return None if network is None else Rule(ports=ports, protocol=a.protocol, network=network)
    return None


def _requests(a: Rule, b: Rule) -> tuple[frozenset[str] | None, tuple[str, ...] | None]:
    """The methods and paths both rules allow (empty: any), None for nothing. Two path lists give
    the globs they share, exactly (a path matching a shared glob passes both sides); globs that only
    overlap are dropped, the narrower side."""
    methods = a.methods & b.methods if a.methods and b.methods else a.methods or b.methods
    if a.methods and b.methods and not methods:
        return None, None
    paths = tuple(sorted(set(a.paths) & set(b.paths))) if a.paths and b.paths else a.paths or b.paths
    if a.paths and b.paths and not paths:
        return methods, None
    return methods, paths


def intersect_hosts(a: str, b: str) -> str | None:
    """The host pattern admitting exactly the names both patterns admit, if any."""
    if _host_within(a, b):
        return a
    if _host_within(b, a):
        return b
    return None


def _host_within(inner: str, outer: str) -> bool:
    """Whether every name `inner` admits is admitted by `outer`: a wildcard `inner` is matched like a
    name, since `*.a.example.org` ends with `.example.org` exactly when `*.example.org` covers it."""
    return inner == outer or host_matches(outer, inner)


def intersect_networks(a: Network, b: Network) -> Network | None:
    if network_within(a, b):  # false across IP families
        return a
    if network_within(b, a):
        return b
    return None
