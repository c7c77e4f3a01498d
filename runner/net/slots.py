"""Per-VM network slots: a namespace with the guest's tap, a veth to the uplink, and its rules.

Creating a namespace, its links and its base tables costs tens of milliseconds, so slots are made
ahead of time in a pool and a job only pays for loading its policy. A slot is reused after a
clean-up that leaves nothing of the previous job behind (rules back to deny-all, conntrack
flushed, resolver and audit state cleared); the VM itself is never reused.
"""

from __future__ import annotations

import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from ipaddress import ip_network

from pyroute2 import IPRoute, NFCTSocket

from policy.blocklist import EMPTY, BlockList
from policy.model import DENY_ALL, Policy, Rule, as_protocol
from policy.render import (
    DNS_ALLOW_CHAIN,
    NAMECHECK_CHAIN,
    OperatorAllowances,
    RenderContext,
    chain_document,
    deny_all,
    dns_allow_rule,
    guard4,
    guard6,
    masquerade,
    namecheck_lines,
    render,
)
from policy.suggest import (
    BLOCK_LISTED,
    BLOCK_LISTED_DEST,
    REFUSED_NAME_DEST,
    SECRET_REFUSED,
    AuditRecord,
    refused_name_record,
)
from runner.errors import NetworkError
from runner.net import addresses, leases, netns
from runner.net.audit import SlotAudit, refused_answer_record
from runner.net.dns import DnsService, Opening, SlotResolver, Upstream
from runner.net.firewall import Firewall, check_policy_document, rules_of
from runner.net.jobca import JobCA
from runner.net.loop import NetLoop
from runner.net.nameproxy import NameProxy
from runner.net.secretswap import SecretSwap
from runner.net.uplink import Uplink

log = logging.getLogger(__name__)

_PREFIX = re.compile(r"[a-z][a-z0-9]{0,8}")


class SlotError(NetworkError):
    """A slot could not be created, configured or cleaned."""


@dataclass
class Slot:
    """One VM's network: namespace `netns` holding `tap` (the guest) and `veth0` (the uplink)."""

    index: int
    netns: str
    tap: str = addresses.TAP_NAME
    firewall: Firewall = field(default_factory=Firewall, repr=False)
    resolver: SlotResolver | None = field(default=None, repr=False)
    audit: SlotAudit | None = field(default=None, repr=False)
    proxy: NameProxy | None = field(default=None, repr=False)
    job: str = ""
    allowances: OperatorAllowances = field(default_factory=OperatorAllowances, repr=False)
    _ipv6_loaded: str = field(default="", repr=False)
    _address_rules: list[Rule] = field(default_factory=list, repr=False)  # the loaded policy's networks, the operator's

    def render_context(self) -> RenderContext:
        return RenderContext(
            guest_ip=addresses.GUEST_IP,
            guest_mac=addresses.GUEST_MAC,
            gateway_ip=addresses.GATEWAY_IP,
            dns_ip=addresses.DNS_IP,
            dns_port=addresses.DNS_PORT,
            guest_iface=self.tap,
            uplink_iface=addresses.VETH_NAME,
            host_addresses=(addresses.uplink_ip(self.index), addresses.veth_ip(self.index)),
            log_prefix=f"mvc:{self.job or self.netns}"[:63],
            nflog_group=addresses.AUDIT_NFLOG_GROUP,
            namecheck_port=addresses.NAMECHECK_PORT,
            namecheck_mark=addresses.NAMECHECK_MARK,
        )

    def apply_policy(self, policy: Policy) -> None:
        """Render and load `policy`; raises (and the VM must not start) when it cannot be loaded.

        The IPv6 document is loaded only when its rules differ from what the slot already has:
        guests have no IPv6 address, so it is nearly always the deny-all the slot was reset to,
        and skipping it halves the cost of readying a slot.

        Audit records are cleared once the rules are loaded: a warm-pool VM runs in the slot before
        a job claims it, and what it tried until now (the guard logs always-denied hits whatever the
        policy) is not the job's. The job's own code runs only after this returns.
        """
        rendered = render(policy, self.render_context(), self.allowances)
        for document, family in ((rendered.ipv4, "IPv4"), (rendered.ipv6, "IPv6")):
            check_policy_document(document, family)
        if self.resolver is not None:
            self.resolver.configure(policy)
        self._address_rules = [*policy.network_rules, *self.allowances.rules]
        if self.proxy is not None:  # a CA of its own for a job whose HTTPS the host must read, else none
            hosts = policy.intercepted_hosts
            self.proxy.ca = JobCA(self.job or self.netns, hosts) if hosts else None
            self.proxy.secrets = None  # the job binds its own, if any, after this (`bind_secrets`)
        # the nat table in the same commit: no opening is redirected yet, none of the last job's is
        self.firewall.load(self.netns, rendered.ipv4 + masquerade(self.render_context(), self._namecheck([])))
        self._load_ipv6(rendered.ipv6)
        if self.audit is not None:
            self.audit.clear()

    def bind_secrets(self, swap: SecretSwap) -> None:
        """Give the job's bound secrets to the name check and the resolver (after `apply_policy`,
        before the guest trusts the job's CA): their hosts are terminated with the job's CA, which
        is made again when it does not vouch for them yet (its name constraints list every name it
        may mint for). Binding an empty swap unbinds."""
        if self.proxy is None or self.resolver is None:
            raise SlotError(f"slot {self.netns} has no name check: secrets cannot be bound in it")
        current = set(self.proxy.ca.hosts if self.proxy.ca is not None else ())
        if not set(swap.hosts) <= current:  # a CA that vouches for them already stays (the guest may trust it)
            self.proxy.ca = JobCA(self.job or self.netns, tuple(sorted(current | set(swap.hosts))))
        self.proxy.secrets = swap if swap.secrets else None
        with self.resolver.lock:
            self.resolver.bound_secrets = swap if swap.secrets else None

    def secret_uses(self) -> dict[str, int]:
        """How many requests each binding's value was swapped into, by binding name."""
        if self.proxy is None:
            return {}
        with self.proxy.lock:
            return dict(self.proxy.used)

    def audit_records(self) -> list[AuditRecord]:
        """What the guest tried that the policy does not allow (logged in both modes), and the
        names whose internal answers the resolver refused (without the addresses: the guest reads this)."""
        if self.audit is None:
            return []
        if self.resolver is None:
            return self.audit.records({})
        records = self.audit.records(dict(self.resolver.handed_out))
        records += [refused_answer_record(*entry) for entry in self.resolver.refused_answer_counts()]
        with self.resolver.lock:
            blocked = sorted(self.resolver.blocked.items())
        records += [AuditRecord(BLOCK_LISTED_DEST, None, "dns", name, count, BLOCK_LISTED) for name, count in blocked]
        with self.resolver.lock:
            misused = sorted(self.resolver.secret_refused.items())
        records += [AuditRecord(REFUSED_NAME_DEST, None, "dns", None, count, SECRET_REFUSED, binding=binding)
                    for binding, count in misused]
        if self.proxy is not None:
            records += self.proxy.records()
        return records + _refused_names(self.resolver, {record.name for record in records})

    def write_dns_chain(self, openings: list[Opening]) -> None:
        """Make the slot's DNS allow chain and its name-check redirects hold exactly the resolver's
        live `openings`, in one commit: name-checked ones only redirect (nat), the rest accept (filter)."""
        lines: list[str] = []
        for opening in openings:
            if not opening.checked:
                lines.extend(dns_allow_rule(opening.address, opening.ports, opening.protocol).splitlines())
        document = chain_document(DNS_ALLOW_CHAIN, lines)
        document += chain_document(NAMECHECK_CHAIN, self._namecheck(openings), table="nat")
        self.firewall.load(self.netns, document, noflush=True)

    def _namecheck(self, openings: list[Opening]) -> list[str]:
        def rule(opening: Opening) -> Rule:
            return Rule(frozenset(opening.ports), as_protocol(opening.protocol), network=ip_network(opening.address))

        raw = [rule(opening) for opening in openings if not opening.checked and opening.protocol == "tcp"]
        checked = [rule(opening) for opening in openings if opening.checked and not opening.audited]
        audited = sorted({opening.address for opening in openings if opening.audited})
        return namecheck_lines(self.render_context(), self._address_rules, raw, checked, audited)

    def reset(self) -> None:
        """Back to the pooled state: deny-all, no connections, no resolver or audit memory."""
        self.job = ""
        self._address_rules = []
        self.firewall.load(self.netns, deny_all() + masquerade(self.render_context()))
        if self.proxy is not None:
            self.proxy.ca = None  # the job's CA key goes with the job
            self.proxy.secrets = None  # and its secrets' values
            self.proxy.clear()
        self._ipv6_loaded = ""
        self._load_ipv6(render(DENY_ALL, self.render_context(), self.allowances).ipv6)
        if self.resolver is not None:
            self.resolver.clear()
        netns.run_in(self.netns, _flush_conntrack)
        if self.audit is not None:
            self.audit.clear()

    def _load_ipv6(self, document: str) -> None:
        loaded = rules_of(document)
        if loaded != self._ipv6_loaded:
            self.firewall.load(self.netns, document, ipv6=True)
            self._ipv6_loaded = loaded


def _refused_names(resolver: SlotResolver, named: set[str | None]) -> list[AuditRecord]:
    """Names the policy has no rule for that the guest looked up (block mode answered NXDOMAIN, so
    nothing else would list them), unless a record names them already (audit mode resolves them,
    and what the guest then dialled is listed with the name)."""
    with resolver.lock:
        refused = sorted(resolver.refused.items())
    return [refused_name_record(name, count) for name, count in refused if name not in named]


def _flush_conntrack() -> None:
    """Forget the previous job's connections, so no reply path of it survives (run inside the slot)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        with NFCTSocket(nfgen_family=family) as ct:
            ct.flush()


def _configure_inside(index: int) -> None:
    """Links, addresses and routes of a new slot (run inside the slot's namespace)."""
    with open("/proc/sys/net/ipv4/ip_forward", "w") as forward:
        forward.write("1\n")
    with IPRoute() as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        veth = ipr.link_lookup(ifname=addresses.VETH_NAME)[0]
        ipr.addr("add", index=veth, address=addresses.veth_ip(index), prefixlen=addresses.UPLINK_PREFIXLEN)
        ipr.link("set", index=veth, state="up")
        ipr.link("add", ifname=addresses.TAP_NAME, kind="tuntap", mode="tap")  # the host opens it (runner.vm.jail)
        tap = ipr.link_lookup(ifname=addresses.TAP_NAME)[0]
        ipr.addr("add", index=tap, address=addresses.GATEWAY_IP, prefixlen=addresses.GUEST_PREFIXLEN)
        ipr.link("set", index=tap, state="up")
        ipr.route("add", dst="0.0.0.0/0", gateway=addresses.uplink_ip(index))


class SlotPool:
    """Pre-created slots named `prefix`-N, handed to one VM at a time.

    `start()` claims the prefix on this host (`runner.net.leases`: a second live pool with it is
    refused), sweeps what a crashed predecessor left behind, prepares the uplink and starts the
    resolver/audit loop; `close()` removes every slot and gives the prefix up. Each slot's index (so
    its uplink /30) is leased on the uplink's namespace, so pools of other prefixes beside it never
    take the same address. Thread-safe.
    """

    def __init__(
        self,
        prefix: str = "mvc",
        uplink: Uplink | None = None,
        size: int = 0,
        *,
        upstream: Upstream | None = None,
        firewall_tools: Firewall | None = None,
        allowances: OperatorAllowances | None = None,
        block_list: BlockList = EMPTY,
        upstream_ca: str | None = None,
        max_slots: int = addresses.MAX_SLOTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` times the resolver's openings (see `runner.net.dns`); tests pass one they can move."""
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"slot prefix {prefix!r} must be 1-9 lowercase letters/digits starting with a letter")
        if uplink is None:
            raise ValueError("a slot pool needs an uplink: HostUplink(out_iface) in production, NamespaceUplink in tests")
        self.prefix = prefix
        self.uplink = uplink
        self.size = size
        self.upstream = upstream or Upstream.from_resolv_conf()
        self.firewall = firewall_tools or Firewall.default()
        self.allowances = allowances or OperatorAllowances()  # the operator's config, never a repository's
        self.block_list = block_list  # the operator's too: refused in every mode (policy.blocklist)
        # What the host trusts when it terminates a job's TLS (methods:/paths:): its own store, plus
        # the operator's extra CA file (an internal registry, a test's fake internet).
        self.upstream_tls = ssl.create_default_context()
        if upstream_ca is not None:
            self.upstream_tls.load_verify_locations(cafile=upstream_ca)
        self.upstream_tls.set_alpn_protocols(["http/1.1"])
        self.max_slots = min(max_slots, addresses.MAX_SLOTS)
        self.clock = clock
        self._lock = threading.Lock()
        self._idle: list[Slot] = []
        self._busy: dict[int, Slot] = {}
        self._claim: leases.Lease | None = None  # the prefix, held from start() to close()
        self._leases: dict[int, leases.Lease] = {}  # the index (uplink /30) of each slot made or being made
        self._loop: NetLoop | None = None
        self._dns: DnsService | None = None
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d+)")

    def __enter__(self) -> SlotPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Claim the prefix, sweep, prepare the uplink and make `size` slots; a failure undoes it all
        (the caller of a failed start has no pool to close, `with` included)."""
        self._claim = leases.claim_prefix(self.prefix)
        try:
            self.sweep()
            self.uplink.prepare(self.prefix, self.allowances)
            self._loop = NetLoop()
            self._dns = DnsService(self._loop, self.upstream, self.clock)
            for _ in range(self.size):
                slot = self._create(self._free_index())
                with self._lock:
                    self._idle.append(slot)
        except BaseException:
            self.close()
            raise

    def acquire(self, job: str = "") -> Slot:
        """A clean, deny-all slot (made now if the pool is empty); load a policy before the VM runs."""
        with self._lock:
            slot = replace(self._idle.pop()) if self._idle else None  # a new handle per lease
            if slot is not None:
                self._busy[slot.index] = slot
        if slot is None:
            slot = self._create(self._free_index(), busy=True)
        slot.job = job
        return slot

    def release(self, slot: Slot) -> None:
        """Clean `slot` and return it to the pool; a slot that cannot be cleaned is destroyed.

        Every acquire hands out a new `Slot` object, so a handle that is no longer out (released
        twice, or another pool's) is recognised and ignored: resetting it would tear down the
        network of the VM that holds the slot now.
        """
        with self._lock:
            if self._busy.get(slot.index) is not slot:
                log.warning("slot %s released but not acquired from pool %s: ignored", slot.netns, self.prefix)
                return
        try:
            slot.reset()
        except Exception as exc:
            log.warning("slot %s could not be cleaned, destroying it: %s", slot.netns, exc)
            self._destroy(slot)
            return
        with self._lock:
            self._busy.pop(slot.index, None)
            self._idle.append(slot)

    def discard(self, slot: Slot) -> None:
        """Destroy `slot` instead of reusing it (e.g. when its VM misbehaved); like `release`, a
        handle that is no longer out is ignored, since destroying it would take another VM's network."""
        with self._lock:
            if self._busy.get(slot.index) is not slot:
                log.warning("slot %s discarded but not acquired from pool %s: ignored", slot.netns, self.prefix)
                return
        self._destroy(slot)

    def live(self) -> list[Slot]:
        with self._lock:
            return [*self._idle, *self._busy.values()]

    def sweep(self) -> list[str]:
        """Remove namespaces and uplink veths named like our slots that no live slot owns: with the
        prefix claimed (`start`), no other live process has any, so they are a dead predecessor's."""
        if self._claim is None:
            raise SlotError(f"pool {self.prefix} sweeps only once started: the prefix may be another process's")
        owned = {slot.netns for slot in self.live()}
        removed: list[str] = []
        for name in netns.names():
            if self._pattern.fullmatch(name) and name not in owned:
                netns.remove(name)
                removed.append(name)
        for name in self.uplink.link_names():
            if self._pattern.fullmatch(name) and name not in owned:
                self.uplink.delete_link(name)
                removed.append(name)
        return removed

    def close(self) -> None:
        with self._lock:
            slots, self._idle, self._busy = [*self._idle, *self._busy.values()], [], {}
        for slot in slots:
            self._destroy(slot, forget=False)
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self._claim is not None:  # a pool refused its prefix must not take down the holder's chains
            self.uplink.close(self.prefix)
            self._claim.release()
            self._claim = None

    def _free_index(self) -> int:
        """The lowest index neither this pool nor another pool on the same uplink holds, now leased."""
        with self._lock:
            for index in range(self.max_slots):
                if index in self._leases:
                    continue
                lease = leases.lease_index(self.uplink.netns, index)
                if lease is not None:
                    self._leases[index] = lease
                    return index
        raise SlotError(f"all {self.max_slots} slots of pool {self.prefix} (and of the other pools on its uplink) "
                        "are in use; release one or raise max_slots")

    def _create(self, index: int, busy: bool = False) -> Slot:
        name = f"{self.prefix}-{index}"
        slot = Slot(index=index, netns=name, firewall=self.firewall, allowances=self.allowances)
        try:
            if self._dns is None or self._loop is None:
                raise SlotError("the pool is not started; call start() first")
            netns.create(name)
            self.uplink.run(lambda: _add_veth(name))
            self.uplink.configure_end(name, index)
            netns.run_in(name, lambda: _configure_inside(index))
            context = slot.render_context()
            self.firewall.load(name, guard4(context, addresses.UPLINK_POOL, self.allowances, self.block_list)
                               + masquerade(context) + deny_all())
            self.firewall.load(name, guard6(context, self.allowances, self.block_list), ipv6=True)
            slot.resolver = self._dns.attach(name, slot.write_dns_chain, self.allowances.rules, self.block_list)
            slot.audit = SlotAudit(name)
            slot.audit.start(self._loop)
            slot.proxy = NameProxy(name, slot.resolver, self.upstream_tls)
            slot.proxy.start(self._loop)
            slot.reset()
        except Exception as exc:
            self._destroy(slot, forget=False)
            raise SlotError(f"cannot create slot {name}: {exc}") from exc
        if busy:
            with self._lock:
                self._busy[index] = slot
        return slot

    def _destroy(self, slot: Slot, forget: bool = True) -> None:
        """Close the slot's sockets first: they pin the namespace (and its veth) in the kernel."""
        if forget:
            with self._lock:
                self._busy.pop(slot.index, None)
                if slot in self._idle:
                    self._idle.remove(slot)
        if slot.audit is not None and self._loop is not None:
            slot.audit.stop(self._loop)
        if slot.proxy is not None and self._loop is not None:
            slot.proxy.stop(self._loop)
        if slot.resolver is not None and self._dns is not None:
            self._dns.detach(slot.resolver)
        netns.remove(slot.netns)
        self.uplink.delete_link(slot.netns)
        with self._lock:
            lease = self._leases.pop(slot.index, None)
        if lease is not None:  # the address is free again only once its veth is gone
            lease.release()


def _add_veth(name: str) -> None:
    """The veth pair of slot `name`: outer end `name` here, `veth0` inside the slot's namespace."""
    with IPRoute() as ipr:
        ipr.link("add", ifname=name, kind="veth", peer={"ifname": addresses.VETH_NAME, "net_ns_fd": name})
