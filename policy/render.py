"""Rendering a policy to the `iptables-restore` / `ip6tables-restore` documents of one VM.

The documents fill the `filter` table of the VM's own network namespace, where the guest's tap
(`guest_iface`) and the uplink veth (`uplink_iface`) meet. Order in FORWARD, first match wins:

1. replies to connections already allowed; invalid packets dropped;
2. anything not entering from the guest dropped (nothing may open a connection *to* the guest),
   anything not leaving by the uplink dropped, and anti-spoofing: only `guest_ip` with `guest_mac`;
3. the DNS service, then the operator's allowances (`OperatorAllowances`);
4. the always-denied destinations (see `policy.reserved`, plus the host's addresses and the gateway)
   dropped by `MVC-DENIED` after an NFLOG tagged `DENIED_LOG_PREFIX`, which *clips* every rule
   below, including addresses a DNS answer points at;
5. the policy's CIDR rules that opt into an internal range (wholly inside one, `policy.reserved.opted_in`);
6. the internal ranges (private, CGNAT, ULA, ...: `policy.reserved.internal_ranges`) sent to
   `MVC-INTERNAL`, which logs them tagged `INTERNAL_LOG_PREFIX` and rejects them, in *both* modes:
   audit mode means "let public egress through and record what block mode would stop", never
   "open the LAN", and a broad rule such as `0.0.0.0/0` is clipped here as it is at step 4;
7. the policy's other CIDR rules, then a jump to the per-VM chain `MVC-DNS-ALLOW` that the DNS
   resolver fills at run time with the addresses it handed out for permitted names (`dns_allow_rule`;
   it hands out an internal address only when a rule of step 5 admits it already);
8. NFLOG of what is left, then the verdict, which is the chain's last rule: REJECT in block mode
   (TCP reset, else ICMP admin-prohibited, so a denied client fails at once instead of timing
   out), ACCEPT in audit mode. `MVC-INTERNAL` rejects the same way, for the same reason.

NFLOG rather than LOG: the service needs what was blocked as data (`blocked_egress` in the job
record), which NFLOG hands to a netlink listener inside the VM's namespace, tagged with the job's
prefix; LOG writes to the kernel ring buffer, where the kernel drops it for non-initial namespaces
unless `nf_log_all_netns` is set, and from where it would have to be scraped back out.

INPUT (the namespace itself: gateway and resolver) admits only the DNS port (UDP and TCP) and the
operator's allowances from the guest, plus the name check's port for connections the slot's nat
table redirected there (TCP under a name-checked `host:` rule, which therefore never reach FORWARD:
their openings are REDIRECTs in the nat table, not ACCEPTs in `MVC-DNS-ALLOW`), and from the uplink
only replies to the name check's own upstream connections. IPv6 is dropped outright unless the guest has an IPv6
address and an IPv6 network rule (the policy's or the operator's) exists; then the same order applies.

This module is the one writer of iptables text. Besides the policy's filter documents it writes the
slot's own tables, which no policy touches (`guard4`/`guard6`: raw and mangle; `masquerade`: nat, with
the name check's redirects `namecheck_lines`; `deny_all`: an idle slot's filter table), the chains the
resolver rewrites at run time (`chain_document`, `dns_allow_rule`) and the host's chains for a slot
pool (`uplink_rules`). `runner.net.firewall` only loads what is written here: one place decides every
rule's shape, so the guard, the policy and the host cannot drift apart (they share `rule_lines` and
`denied_chain_lines`). Everything here is pure: the slot's addresses come in a `RenderContext`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, ip_address, ip_network
from pathlib import Path

import jinja2

from policy.blocklist import EMPTY, BlockList
from policy.model import Address, Policy, Rule, as_protocol
from policy.reserved import always_denied, internal_ranges, opted_in

DNS_ALLOW_CHAIN = "MVC-DNS-ALLOW"
GUARD_CHAIN = "MVC-GUARD"
NAMECHECK_CHAIN = "MVC-NAMECHECK"
DENIED_CHAIN = "MVC-DENIED"
# NFLOG prefix of always-denied hits; "!" is outside `RenderContext.log_prefix`'s alphabet, so no job's
# prefix can pass for it and the audit reader can tell "no policy may allow this" from "not allowed".
DENIED_LOG_PREFIX = "mvc!always-denied"
INTERNAL_CHAIN = "MVC-INTERNAL"
# NFLOG prefix of hits on the operator's block list (`policy.blocklist`, in the slot's raw guard); "!" as above.
BLOCKED_LOG_PREFIX = "mvc!block-listed"
BLOCKED_CHAIN = "MVC-BLOCKED"
# NFLOG prefix of internal-range hits that no opting-in rule admits (reason `internal-address`); "!" as above.
INTERNAL_LOG_PREFIX = "mvc!internal-address"
# Every NFLOG rule is rate-limited: a guest flooding denied destinations would otherwise make the host
# parse each packet on the loop thread that also answers every VM's DNS. The limit is per rule, not per
# VM: each of a slot's NFLOG rules (the raw guard's MVC-DENIED in IPv4 and IPv6, and the filter table's
# MVC-DENIED, MVC-INTERNAL and final FORWARD log, in IPv4 and in IPv6 when it is enabled) has its own
# 100 a second (bursts of 200), so one VM can have about 500 packets a second logged, 800 with IPv6
# rules. That is far more than a job's connection attempts, and still bounded; under a flood the
# counts are lower bounds.
LOG_LIMIT = "-m limit --limit 100/second --limit-burst 200"
MULTIPORT_SLOTS = 15  # iptables' multiport limit; a range a:b takes two slots

_IFACE = re.compile(r"[A-Za-z0-9_.-]{1,15}")
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
_PREFIX = re.compile(r"[A-Za-z0-9_.:=/-]{1,63}")

# Loaded by path, not by package name: found the same way however `policy` itself was imported.
_templates = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)


@dataclass(frozen=True, kw_only=True)
class RenderContext:
    """Where one VM's rules apply. Every field ends up inside an iptables document, so each is
    validated here rather than trusted."""

    guest_ip: IPv4Address | str
    guest_mac: str
    gateway_ip: IPv4Address | str
    dns_ip: IPv4Address | str
    guest_iface: str = "tap0"
    uplink_iface: str = "veth0"
    dns_port: int = 53
    host_addresses: tuple[Address | str, ...] = ()
    log_prefix: str = "mvc"
    nflog_group: int = 100  # runner.net.addresses.AUDIT_NFLOG_GROUP reads this group
    guest_ip6: IPv6Address | str | None = None
    # The name check (runner.net.nameproxy) on the gateway: INPUT admits the guest there only for
    # connections the nat table redirected (ctstate DNAT), and from the uplink only replies to its
    # own marked upstream connections (connmark). 0: no name check in this namespace.
    namecheck_port: int = 0
    namecheck_mark: int = 0

    def __post_init__(self) -> None:
        for name in ("guest_ip", "gateway_ip", "dns_ip"):
            object.__setattr__(self, name, _ipv4(name, getattr(self, name)))
        if self.guest_ip6 is not None:
            object.__setattr__(self, "guest_ip6", _ipv6("guest_ip6", self.guest_ip6))
        object.__setattr__(self, "host_addresses", tuple(ip_address(a) for a in self.host_addresses))
        object.__setattr__(self, "guest_mac", self.guest_mac.lower())
        _check(_MAC.fullmatch(self.guest_mac), f"guest_mac {self.guest_mac!r} is not a MAC like 52:54:00:12:34:56")
        for name in ("guest_iface", "uplink_iface"):
            _check(_IFACE.fullmatch(getattr(self, name)), f"{name} {getattr(self, name)!r} is not an interface name")
        _check(self.guest_iface != self.uplink_iface, "guest_iface and uplink_iface must differ")
        _check(1 <= self.dns_port <= 65535, f"dns_port {self.dns_port} is out of range 1..65535")
        _check(_PREFIX.fullmatch(self.log_prefix),
               f"log_prefix {self.log_prefix!r} must be 1..63 of A-Z a-z 0-9 _ . : = / -")
        _check(0 <= self.nflog_group <= 65535, f"nflog_group {self.nflog_group} is out of range 0..65535")
        _check(0 <= self.namecheck_port <= 65535, f"namecheck_port {self.namecheck_port} is out of range 0..65535")
        _check(0 <= self.namecheck_mark < 2**32, f"namecheck_mark {self.namecheck_mark} is out of range")
        _check(bool(self.namecheck_port) == bool(self.namecheck_mark), "namecheck_port and namecheck_mark go together")


@dataclass(frozen=True)
class OperatorAllowances:
    """Network rules from the runner operator's own config: rendered before the always-denied
    destinations, so they are the only way to open e.g. the metadata service, a host address or a
    service on the gateway. Never built from a repository's or a job's policy."""

    rules: tuple[Rule, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        for rule in self.rules:
            _check(rule.network is not None, f"operator allowance {rule.destination} must be a network, not a host name")


@dataclass(frozen=True)
class RenderedRules:
    ipv4: str  # for iptables-restore
    ipv6: str  # for ip6tables-restore


def render(policy: Policy, context: RenderContext,
           allowances: OperatorAllowances = OperatorAllowances()) -> RenderedRules:
    """Both documents for one VM (see the module doc for the order and its reasons)."""
    ipv6_enabled = context.guest_ip6 is not None and any(
        rule.in_family(6) for rule in (*policy.network_rules, *allowances.rules))
    common = {"ctx": context, "policy": policy, "digest": policy.digest(), "dns_chain": DNS_ALLOW_CHAIN,
              "denied_chain": DENIED_CHAIN, "denied_lines": denied_chain_lines(context.nflog_group),
              "internal_chain": INTERNAL_CHAIN, "internal_log_prefix": INTERNAL_LOG_PREFIX,
              "log_limit": LOG_LIMIT}
    ipv4 = _templates.get_template("filter4.rules.j2").render(
        **common, **_family_view(4, policy, context, allowances))
    ipv6 = _templates.get_template("filter6.rules.j2").render(
        **common, **_family_view(6, policy, context, allowances), enabled=ipv6_enabled)
    return RenderedRules(ipv4=ipv4, ipv6=ipv6)


def dns_allow_rule(ip: Address | str, ports: Iterable[int], protocol: str) -> str:
    """The rule(s) the DNS resolver appends to `MVC-DNS-ALLOW` after answering a permitted name.

    Returns one `-A MVC-DNS-ALLOW -d <ip>/<32|128> -p <proto> -m multiport --dports <ports> -j ACCEPT`
    line per 15-slot port group (newline-separated). Each line is valid both inside an
    `iptables-restore --noflush` document (`*filter` ... `COMMIT`) and, split on whitespace, as the
    arguments of `iptables`/`ip6tables` (use `ip6tables` when the address is IPv6). The address is
    parsed here, so a hostile DNS answer cannot inject options; addresses in always-denied and
    internal ranges are harmless because the chain is consulted only after those are refused.
    """
    network = ip_network(ip_address(ip))
    rule = Rule(frozenset(ports), as_protocol(protocol), network=network)  # checks ports and protocol
    return "\n".join(rule_lines(DNS_ALLOW_CHAIN, rule, "ACCEPT"))


def rule_lines(chain: str, rule: Rule, target: str, match: str = "") -> list[str]:
    """`-A <chain> [match]-d <network> -p <proto> -m multiport --dports <group> -j <target>`, one line
    per port group: the one shape of a network rule, in the policy's documents and everywhere that must
    agree with them (the resolver's chain, the slot's guard and nat table, the host's own chains)."""
    _check(rule.network is not None, f"{rule.destination} must be a network, not a host name")
    return [f"-A {chain} {match}-d {rule.network} -p {rule.protocol} -m multiport --dports {group} -j {target}"
            for group in port_groups(rule.ports)]


def denied_chain_lines(nflog_group: int) -> list[str]:
    """The `MVC-DENIED` chain's rules, in the rendered documents and the slot's raw guard alike: log
    (tagged `DENIED_LOG_PREFIX`, rate-limited), then drop."""
    return [
        f'-A {DENIED_CHAIN} {LOG_LIMIT} -j NFLOG --nflog-group {nflog_group} --nflog-prefix "{DENIED_LOG_PREFIX}"',
        f"-A {DENIED_CHAIN} -j DROP",
    ]


def deny_all() -> str:
    """The IPv4 filter table of an idle slot: nothing in, nothing through (IPv6: `render(DENY_ALL, ...)`)."""
    return "*filter\n:INPUT DROP [0:0]\n:FORWARD DROP [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"


def guard4(context: RenderContext, uplink_pool: IPv4Network,
           allowances: OperatorAllowances = OperatorAllowances(), block_list: BlockList = EMPTY) -> str:
    """Raw-table guard that holds whatever policy is loaded: defence in depth under the policy.

    Frames from the guest must carry its MAC and IP; they may reach the namespace's own addresses
    only at the DNS service, and never the uplink range (`uplink_pool`), link-local, loopback or
    multicast (the first three and the namespace's own addresses logged as always-denied, see
    `_guard_denied`). The namespace itself originates nothing towards the uplink but the name check's
    upstream TCP connections, whose sockets carry `namecheck_mark` (setting it needs CAP_NET_ADMIN,
    which no guest-facing process has; QEMU runs in a namespace of its own anyway): the resolver asks
    upstream from outside. And nothing from the uplink side reaches the namespace's own sockets
    (mangle INPUT, after NAT has turned replies for the guest back into forwarded traffic) but
    replies on those marked connections (the mark is saved to conntrack on the way out).
    """
    dns, uplink, mark = context.dns_ip, context.uplink_iface, hex(context.namecheck_mark)
    raw = [
        f"-A {GUARD_CHAIN} ! -s {context.guest_ip}/32 -j DROP",
        f"-A {GUARD_CHAIN} -d {dns}/32 -p udp -m udp --dport {context.dns_port} -j RETURN",
        f"-A {GUARD_CHAIN} -d {dns}/32 -p tcp -m tcp --dport {context.dns_port} -j RETURN",
        *_blocked(context, block_list, 4),
        *_allowed(allowances, 4),
        f"-A {GUARD_CHAIN} -m addrtype --dst-type LOCAL -j {DENIED_CHAIN}",
        f"-A {GUARD_CHAIN} -m addrtype --dst-type BROADCAST -j DROP",
        f"-A {GUARD_CHAIN} -d {uplink_pool} -j {DENIED_CHAIN}",
        f"-A {GUARD_CHAIN} -d 169.254.0.0/16 -j {DENIED_CHAIN}",
        f"-A {GUARD_CHAIN} -d 127.0.0.0/8 -j {DENIED_CHAIN}",
        f"-A {GUARD_CHAIN} -d 224.0.0.0/3 -j DROP",
        *_guard_denied(context),
        f"-A OUTPUT -o {uplink} -p tcp -m mark --mark {mark} -j ACCEPT",
        f"-A OUTPUT -o {uplink} -j DROP",
    ]
    mangle = [
        f"-A OUTPUT -o {uplink} -m mark --mark {mark} -j CONNMARK --save-mark",
        f"-A INPUT -i {uplink} -m connmark --mark {mark} -j ACCEPT",
        f"-A INPUT -i {uplink} -j DROP",
    ]
    return _document(_guard_table(context, raw), _table("mangle", mangle))


def guard6(context: RenderContext, allowances: OperatorAllowances = OperatorAllowances(),
           block_list: BlockList = EMPTY) -> str:
    """IPv6 guard: the guest's MAC only, the namespace's own addresses only for neighbour discovery,
    and nothing but neighbour discovery originated by the namespace towards the uplink."""
    uplink, nd = context.uplink_iface, ("neighbour-solicitation", "neighbour-advertisement")
    raw = [
        *(f"-A {GUARD_CHAIN} -p ipv6-icmp -m icmp6 --icmpv6-type {kind} -j RETURN" for kind in nd),
        *_blocked(context, block_list, 6),
        *_allowed(allowances, 6),
        f"-A {GUARD_CHAIN} -m addrtype --dst-type LOCAL -j {DENIED_CHAIN}",
        *_guard_denied(context),
        *(f"-A OUTPUT -o {uplink} -p ipv6-icmp -m icmp6 --icmpv6-type {kind} -j ACCEPT" for kind in nd),
        f"-A OUTPUT -o {uplink} -j DROP",
    ]
    mangle = [
        *(f"-A INPUT -i {uplink} -p ipv6-icmp -m icmp6 --icmpv6-type {kind} -j ACCEPT" for kind in nd),
        f"-A INPUT -i {uplink} -j DROP",
    ]
    return _document(_guard_table(context, raw), _table("mangle", mangle))


def _blocked(context: RenderContext, block_list: BlockList, version: int) -> list[str]:
    """The operator's block list, before the operator's own allowances and any policy: logged as
    block-listed, then dropped (the raw table cannot reject), in every mode."""
    networks = [network for network in block_list.networks if network.version == version]
    if not networks:
        return []
    return [*(f"-A {GUARD_CHAIN} -d {network} -j {BLOCKED_CHAIN}" for network in networks),
            f'-A {BLOCKED_CHAIN} {LOG_LIMIT} -j NFLOG --nflog-group {context.nflog_group} '
            f'--nflog-prefix "{BLOCKED_LOG_PREFIX}"',
            f"-A {BLOCKED_CHAIN} -j DROP"]


def _guard_table(context: RenderContext, rules: list[str]) -> list[str]:
    """The raw table of both families: everything from the tap goes through `GUARD_CHAIN`, which
    first drops any frame not carrying the guest's MAC, then applies the family's `rules`."""
    entry = [f"-A PREROUTING -i {context.guest_iface} -j {GUARD_CHAIN}",
             f"-A {GUARD_CHAIN} -m mac ! --mac-source {context.guest_mac} -j DROP"]
    return _table("raw", [*entry, *rules], chains=(GUARD_CHAIN, DENIED_CHAIN, BLOCKED_CHAIN))


def _allowed(allowances: OperatorAllowances, version: int) -> list[str]:
    """The operator's allowances pass the guard (to the policy, which admits them first): the
    operator's config is the one place that may open what the guard otherwise closes (networks only,
    which `OperatorAllowances` checks)."""
    return [line for rule in allowances.rules if rule.in_family(version)
            for line in rule_lines(GUARD_CHAIN, rule, "RETURN")]


def _guard_denied(context: RenderContext) -> list[str]:
    """Log, then drop, as the policy's own MVC-DENIED chain does: a job's summary shows that it
    tried the host or the metadata service.

    Broadcast, multicast and spoofed frames are dropped unlogged: they are not connection attempts,
    and a guest kernel sends some on its own.
    """
    return denied_chain_lines(context.nflog_group)


def masquerade(context: RenderContext, namecheck: Sequence[str] = ()) -> str:
    """The slot's nat table. Every guest has the same IP, so its traffic leaves as the slot's
    unique veth address; new TCP connections from the guest pass `NAMECHECK_CHAIN`, which
    redirects those under a name-checked rule to the name check (`namecheck_lines`)."""
    return _document(_table("nat", [
        f"-A PREROUTING -i {context.guest_iface} -p tcp -j {NAMECHECK_CHAIN}",
        *namecheck,
        f"-A POSTROUTING -s {context.guest_ip}/32 -o {context.uplink_iface} -j MASQUERADE",
    ], chains=(NAMECHECK_CHAIN,)))


def namecheck_lines(context: RenderContext, address_rules: Sequence[Rule], raw: Sequence[Rule],
                    checked: Sequence[Rule], audited: Sequence[str] = ()) -> list[str]:
    """`NAMECHECK_CHAIN`'s rules, first match wins: what a network rule (the policy's `cidr:` or the
    operator's allowance) or a `raw: true` opening admits keeps address semantics (RETURN, on to the
    filter table), then the name-checked openings are redirected to the name check, and last, in
    audit mode, every other TCP port of an address the resolver handed out (`audited`: observed,
    not refused, see `runner.net.dns.Opening`).

    A raw opening never covers a port a name-checked opening has at its address (one CDN address
    serving a raw host and a `paths:`-checked one): there the stricter wins, and connections go
    through the name check, which admits only names of checked rules (`policy check` warns)."""
    tcp = [rule for rule in address_rules if rule.protocol == "tcp" and rule.in_family(4)]
    redirect = f"REDIRECT --to-ports {context.namecheck_port}"
    return [*(line for rule in (*tcp, *_unchecked(raw, checked))
              for line in rule_lines(NAMECHECK_CHAIN, rule, "RETURN")),
            *(line for rule in checked for line in rule_lines(NAMECHECK_CHAIN, rule, redirect)),
            *(f"-A {NAMECHECK_CHAIN} -d {address}/32 -p tcp -j {redirect}" for address in audited)]


def _unchecked(raw: Sequence[Rule], checked: Sequence[Rule]) -> list[Rule]:
    """The raw openings without the ports a checked opening has at the same address."""
    kept = []
    for rule in raw:
        ports = rule.ports.difference(*(other.ports for other in checked if other.network == rule.network))
        if ports:
            kept.append(Rule(ports, rule.protocol, network=rule.network))
    return kept


def chain_document(chain: str, rules: Sequence[str], table: str = "filter") -> str:
    """A `--noflush` document that replaces user chain `chain` of `table` with `rules`
    (`-A chain ...` lines) in one commit, and leaves every other chain alone: declaring a chain
    empties it, with the legacy and the nf_tables backend alike."""
    return f"*{table}\n:{chain} - [0:0]\n" + "".join(rule + "\n" for rule in rules) + "COMMIT\n"


@dataclass(frozen=True)
class HostChains:
    """The host's chains of one slot pool (`runner.net.uplink.HostUplink`): into the host (filter
    INPUT), through it (filter FORWARD) and its NAT (nat POSTROUTING)."""

    into_host: str
    through: str
    nat: str


def uplink_rules(chains: HostChains, slots: str, out_iface: str, pool: IPv4Network,
                 allowances: OperatorAllowances = OperatorAllowances()) -> list[tuple[str, str]]:
    """(table, `-A ...` line) of the host's chains for the slots whose outer veth ends match `slots`
    (an iptables interface pattern): the host is closed to them but for the operator's IPv4
    allowances (a caching proxy the operator runs on the host, say), they leave only by `out_iface`
    from `pool`, only replies come back, and they are masqueraded on the way out. Each line is
    also valid split on whitespace as the arguments of `iptables -t <table>`."""
    into = [line for rule in allowances.rules if rule.in_family(4)  # OperatorAllowances holds networks only
            for line in rule_lines(chains.into_host, rule, "ACCEPT", match=f"-i {slots} ")]
    filter_lines = [
        *into,
        f"-A {chains.into_host} -i {slots} -j DROP",
        f"-A {chains.through} -i {slots} -o {out_iface} -s {pool} -j ACCEPT",
        f"-A {chains.through} -i {slots} -j DROP",
        f"-A {chains.through} -o {slots} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
        f"-A {chains.through} -o {slots} -j DROP",
    ]
    return [*(("filter", line) for line in filter_lines),
            ("nat", f"-A {chains.nat} -s {pool} -o {out_iface} -j MASQUERADE")]


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


def _family_view(version: int, policy: Policy, context: RenderContext,
                 allowances: OperatorAllowances) -> dict[str, object]:
    denied = [str(reserved.network) for reserved in always_denied(version)]
    denied += [str(ip_network(a)) for a in context.host_addresses if ip_address(a).version == version]
    if version == 4:
        denied.append(str(ip_network(context.gateway_ip)))
    operator = [rule for rule in allowances.rules if rule.in_family(version)]
    source = f"-s {context.guest_ip6}/128 " if version == 6 else ""  # v4 INPUT checks the source earlier
    networks = [rule for rule in policy.network_rules if rule.in_family(version)]
    return {
        "operator_input": [line for rule in operator
                           for line in rule_lines("INPUT", rule, "ACCEPT", f"-i {context.guest_iface} {source}")],
        "operator_forward": [line for rule in operator for line in rule_lines("FORWARD", rule, "ACCEPT")],
        "denied": list(dict.fromkeys(denied)),
        "internal_accepts": [line for rule in networks if _opted_in(rule)
                             for line in rule_lines("FORWARD", rule, "ACCEPT")],
        "internal": [internal.match for internal in internal_ranges(version) if not internal.always_denied],
        "accepts": [line for rule in networks if not _opted_in(rule)
                    for line in rule_lines("FORWARD", rule, "ACCEPT")],
    }


def _opted_in(rule: Rule) -> bool:
    """Whether a network rule opts into an internal range (`policy.reserved.opted_in`)."""
    return rule.network is not None and opted_in(rule.network)


def port_groups(ports: Iterable[int]) -> list[str]:
    """`--dports` arguments covering `ports`, consecutive ports folded into ranges, each within
    multiport's 15-slot limit."""
    ranges: list[list[int]] = []
    for port in sorted(set(ports)):
        if ranges and ranges[-1][1] == port - 1:
            ranges[-1][1] = port
        else:
            ranges.append([port, port])
    groups: list[list[str]] = [[]]
    used = 0
    for low, high in ranges:
        item, slots = (str(low), 1) if low == high else (f"{low}:{high}", 2)
        if used + slots > MULTIPORT_SLOTS:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += slots
    return [",".join(group) for group in groups if group]


def _ipv4(name: str, value: IPv4Address | str) -> IPv4Address:
    address = ip_address(value)
    if not isinstance(address, IPv4Address):
        raise ValueError(f"{name} {value} must be an IPv4 address")
    return address


def _ipv6(name: str, value: IPv6Address | str) -> IPv6Address:
    address = ip_address(value)
    if not isinstance(address, IPv6Address):
        raise ValueError(f"{name} {value} must be an IPv6 address")
    return address


def _check(condition: object, message: str) -> None:
    if not condition:
        raise ValueError(message)
