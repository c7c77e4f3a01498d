"""Loading iptables documents into a slot's namespace, whole tables at once.

The slot owns `raw` and `mangle` (a guard against spoofing and against reaching the namespace
itself, installed once and never touched by a policy), `nat` (the guest's masquerade) and `filter`
(the egress policy, replaced atomically by `iptables-restore` before the VM resumes). The legacy
backend is the default because it loads a policy in about 4 ms here against 10-20 ms for nf_tables,
and the namespace is ours alone, so nothing else has to agree on the backend.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from policy.blocklist import EMPTY, BlockList
from policy.model import Rule
from policy.render import (
    BLOCKED_CHAIN,
    BLOCKED_LOG_PREFIX,
    DENIED_CHAIN,
    LOG_LIMIT,
    OperatorAllowances,
    denied_chain_lines,
    rule_lines,
)
from runner.errors import NetworkError
from runner.net import addresses, netns

POLICY_TABLES = frozenset({"filter"})
_TABLE_LINE = re.compile(r"^\*(\S+)\s*$", re.MULTILINE)


class FirewallError(NetworkError):
    """Rules could not be loaded; the slot must not run a VM."""


@dataclass(frozen=True)
class Firewall:
    """Which iptables-restore binaries load the rules (both families must use the same backend)."""

    restore4: str = "iptables-legacy-restore"
    restore6: str = "ip6tables-legacy-restore"
    timeout: float = 10.0

    @classmethod
    def nft(cls) -> Firewall:
        return cls("iptables-nft-restore", "ip6tables-nft-restore")

    @classmethod
    def default(cls) -> Firewall:
        """Legacy when this host has it (faster), else nf_tables."""
        return cls() if shutil.which(cls.restore4) and shutil.which(cls.restore6) else cls.nft()

    def load(self, ns: str, document: str, *, ipv6: bool = False, noflush: bool = False) -> None:
        """Load `document` into namespace `ns`; every table it names is replaced in one commit."""
        # The legacy backend's lock (/run/xtables.lock) is host-wide, not per namespace: wait for it
        # instead of failing when another slot (or anything else on the host) is loading rules.
        argv = [self.restore6 if ipv6 else self.restore4, f"--wait={int(self.timeout)}"]
        if noflush:
            argv.append("--noflush")

        def run() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(argv, input=document.encode(), capture_output=True, timeout=self.timeout)

        try:
            done = netns.run_in(ns, run)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FirewallError(f"{argv[0]} in namespace {ns} failed to run: {exc}") from exc
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip()
            raise FirewallError(f"{argv[0]} rejected the rules for namespace {ns}: {detail}")


def tables_of(document: str) -> set[str]:
    return set(_TABLE_LINE.findall(document))


def rules_of(document: str) -> str:
    """The document without comments and blank lines: what the kernel ends up with."""
    return "\n".join(line for line in document.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def check_policy_document(document: str, family: str) -> None:
    """Refuse a rendered policy that would overwrite the slot's own tables (raw, mangle, nat)."""
    tables = tables_of(document)
    if not tables:
        raise FirewallError(f"the rendered {family} policy names no table; expected *filter")
    foreign = tables - POLICY_TABLES
    if foreign:
        raise FirewallError(
            f"the rendered {family} policy writes table(s) {sorted(foreign)}, which belong to the "
            "slot (guard and masquerade); a policy may only write *filter"
        )


def deny_all() -> str:
    """The IPv4 filter table of an idle slot: nothing in, nothing through (IPv6: the renderer's deny-all)."""
    return "*filter\n:INPUT DROP [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"


def guard4(allowances: OperatorAllowances = OperatorAllowances(), block_list: BlockList = EMPTY) -> str:
    """Raw-table guard that holds whatever policy is loaded: defence in depth under the policy.

    Frames from the guest must carry its MAC and IP; they may reach the namespace's own addresses
    only at the DNS service, and never the uplink range, link-local, loopback or multicast (the first
    three and the namespace's own addresses logged as always-denied, see `_denied_chain`). The
    namespace itself originates nothing towards the uplink but the name check's upstream TCP
    connections, whose sockets carry `NAMECHECK_MARK` (setting it needs CAP_NET_ADMIN, which no
    guest-facing process has; QEMU runs in a namespace of its own anyway): the resolver asks
    upstream from outside. And nothing from the uplink side reaches the namespace's own sockets
    (mangle INPUT, after NAT has turned replies for the guest back into forwarded traffic) but
    replies on those marked connections (the mark is saved to conntrack on the way out).
    """
    dns = addresses.DNS_IP
    mark = hex(addresses.NAMECHECK_MARK)
    raw = [
        f"-A MVC-GUARD ! -s {addresses.GUEST_IP}/32 -j DROP",
        f"-A MVC-GUARD -d {dns}/32 -p udp -m udp --dport {addresses.DNS_PORT} -j RETURN",
        f"-A MVC-GUARD -d {dns}/32 -p tcp -m tcp --dport {addresses.DNS_PORT} -j RETURN",
        *_blocked(block_list, 4),
        *_allowed(allowances, 4),
        f"-A MVC-GUARD -m addrtype --dst-type LOCAL -j {DENIED_CHAIN}",
        "-A MVC-GUARD -m addrtype --dst-type BROADCAST -j DROP",
        f"-A MVC-GUARD -d {addresses.UPLINK_POOL} -j {DENIED_CHAIN}",
        f"-A MVC-GUARD -d 169.254.0.0/16 -j {DENIED_CHAIN}",
        f"-A MVC-GUARD -d 127.0.0.0/8 -j {DENIED_CHAIN}",
        "-A MVC-GUARD -d 224.0.0.0/3 -j DROP",
        *_denied_chain(),
        f"-A OUTPUT -o {addresses.VETH_NAME} -p tcp -m mark --mark {mark} -j ACCEPT",
        f"-A OUTPUT -o {addresses.VETH_NAME} -j DROP",
    ]
    mangle = [
        f"-A OUTPUT -o {addresses.VETH_NAME} -m mark --mark {mark} -j CONNMARK --save-mark",
        f"-A INPUT -i {addresses.VETH_NAME} -m connmark --mark {mark} -j ACCEPT",
        f"-A INPUT -i {addresses.VETH_NAME} -j DROP",
    ]
    return _document(_guard_table(raw), _table("mangle", mangle))


def _blocked(block_list: BlockList, version: int) -> list[str]:
    """The operator's block list, before the operator's own allowances and any policy: logged as
    block-listed, then dropped (the raw table cannot reject), in every mode."""
    networks = [network for network in block_list.networks if network.version == version]
    if not networks:
        return []
    return [*(f"-A MVC-GUARD -d {network} -j {BLOCKED_CHAIN}" for network in networks),
            f'-A {BLOCKED_CHAIN} {LOG_LIMIT} -j NFLOG --nflog-group {addresses.AUDIT_NFLOG_GROUP} '
            f'--nflog-prefix "{BLOCKED_LOG_PREFIX}"',
            f"-A {BLOCKED_CHAIN} -j DROP"]


def guard6(allowances: OperatorAllowances = OperatorAllowances(), block_list: BlockList = EMPTY) -> str:
    """IPv6 guard: the guest's MAC only, the namespace's own addresses only for neighbour discovery,
    and nothing but neighbour discovery originated by the namespace towards the uplink."""
    veth, nd = addresses.VETH_NAME, ("neighbour-solicitation", "neighbour-advertisement")
    raw = [
        *(f"-A MVC-GUARD -p ipv6-icmp -m icmp6 --icmpv6-type {kind} -j RETURN" for kind in nd),
        *_blocked(block_list, 6),
        *_allowed(allowances, 6),
        f"-A MVC-GUARD -m addrtype --dst-type LOCAL -j {DENIED_CHAIN}",
        *_denied_chain(),
        *(f"-A OUTPUT -o {veth} -p ipv6-icmp -m icmp6 --icmpv6-type {kind} -j ACCEPT" for kind in nd),
        f"-A OUTPUT -o {veth} -j DROP",
    ]
    mangle = [
        *(f"-A INPUT -i {veth} -p ipv6-icmp -m icmp6 --icmpv6-type {kind} -j ACCEPT" for kind in nd),
        f"-A INPUT -i {veth} -j DROP",
    ]
    return _document(_guard_table(raw), _table("mangle", mangle))


def _guard_table(rules: list[str]) -> list[str]:
    """The raw table of both families: everything from the tap goes through `MVC-GUARD`, which
    first drops any frame not carrying the guest's MAC, then applies the family's `rules`."""
    entry = [f"-A PREROUTING -i {addresses.TAP_NAME} -j MVC-GUARD", f"-A MVC-GUARD -m mac ! --mac-source {addresses.GUEST_MAC} -j DROP"]
    return _table("raw", [*entry, *rules], chains=("MVC-GUARD", DENIED_CHAIN, BLOCKED_CHAIN))


def _allowed(allowances: OperatorAllowances, version: int) -> list[str]:
    """The operator's allowances pass the guard (to the policy, which admits them first): the
    operator's config is the one place that may open what the guard otherwise closes (networks only,
    which `OperatorAllowances` checks)."""
    return [line for rule in allowances.rules if rule.in_family(version)
            for line in rule_lines("MVC-GUARD", rule, "RETURN")]


def _denied_chain() -> list[str]:
    """Log, then drop, as the policy's own MVC-DENIED chain does: a job's summary shows that it
    tried the host or the metadata service.

    Broadcast, multicast and spoofed frames are dropped unlogged: they are not connection attempts,
    and a guest kernel sends some on its own.
    """
    return denied_chain_lines(addresses.AUDIT_NFLOG_GROUP)


NAMECHECK_CHAIN = "MVC-NAMECHECK"


def masquerade(namecheck: list[str] | None = None) -> str:
    """The slot's nat table. Every guest has the same IP, so its traffic leaves as the slot's
    unique veth address; new TCP connections from the guest pass `NAMECHECK_CHAIN`, which
    redirects those under a name-checked rule to the name check (`namecheck_lines`)."""
    return _document(_table("nat", [
        f"-A PREROUTING -i {addresses.TAP_NAME} -p tcp -j {NAMECHECK_CHAIN}",
        *(namecheck or []),
        f"-A POSTROUTING -s {addresses.GUEST_IP}/32 -o {addresses.VETH_NAME} -j MASQUERADE",
    ], chains=(NAMECHECK_CHAIN,)))


def namecheck_lines(address_rules: list[Rule], raw: list[Rule], checked: list[Rule],
                    audited: Sequence[str] = ()) -> list[str]:
    """`NAMECHECK_CHAIN`'s rules, first match wins: what a network rule (the policy's `cidr:` or the
    operator's allowance) or a `raw: true` opening admits keeps address semantics (RETURN, on to the
    filter table), then the name-checked openings are redirected to the name check, and last, in
    audit mode, every other TCP port of an address the resolver handed out (`audited`: observed,
    not refused, see `runner.net.dns.Opening`).

    A raw opening never covers a port a name-checked opening has at its address (one CDN address
    serving a raw host and a `paths:`-checked one): there the stricter wins, and connections go
    through the name check, which admits only names of checked rules (`policy check` warns)."""
    tcp = [rule for rule in address_rules if rule.protocol == "tcp" and rule.in_family(4)]
    redirect = f"REDIRECT --to-ports {addresses.NAMECHECK_PORT}"
    return [*(line for rule in (*tcp, *_unchecked(raw, checked)) for line in rule_lines(NAMECHECK_CHAIN, rule, "RETURN")),
            *(line for rule in checked for line in rule_lines(NAMECHECK_CHAIN, rule, redirect)),
            *(f"-A {NAMECHECK_CHAIN} -d {address}/32 -p tcp -j {redirect}" for address in audited)]


def _unchecked(raw: list[Rule], checked: list[Rule]) -> list[Rule]:
    """The raw openings without the ports a checked opening has at the same address."""
    kept = []
    for rule in raw:
        ports = rule.ports.difference(*(other.ports for other in checked if other.network == rule.network))
        if ports:
            kept.append(Rule(ports, rule.protocol, network=rule.network))
    return kept


_BUILTIN_CHAINS = {
    "raw": ("PREROUTING", "OUTPUT"),
    "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
}


def _table(name: str, rules: list[str], chains: tuple[str, ...] = ()) -> list[str]:
    """One table of an iptables-restore document: built-in chains accepting, our `chains` declared."""
    return [f"*{name}", *(f":{chain} ACCEPT [0:0]" for chain in _BUILTIN_CHAINS[name]),
            *(f":{chain} - [0:0]" for chain in chains), *rules, "COMMIT"]


def _document(*tables: list[str]) -> str:
    return "\n".join([line for table in tables for line in table] + [""])


def chain_document(chain: str, rules: list[str], table: str = "filter") -> str:
    """A `--noflush` document that replaces user chain `chain` of `table` with `rules`
    (`-A chain ...` lines) in one commit, and leaves every other chain alone: declaring a chain
    empties it, with the legacy and the nf_tables backend alike."""
    return f"*{table}\n:{chain} - [0:0]\n" + "".join(rule + "\n" for rule in rules) + "COMMIT\n"
