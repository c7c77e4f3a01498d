"""The guests' resolver: answers only names the slot's policy allows, and opens what it hands out.

Each slot has UDP and TCP sockets on 192.0.2.1:53 inside its namespace; one `NetLoop` thread
serves them all. A guest query is never forwarded as-is: the resolver asks the upstream a fresh
question of its own (so nothing the guest puts in a packet reaches the upstream but the name), keeps
only the address records for that name, opens exactly those addresses on the rule's ports in the
slot's allow chain, and only then answers, so the guest's first connection is already allowed.

What a name resolves to is only as trustworthy as whoever controls its DNS today (a wildcard rule, a
lapsed domain), so answers pointing into internal ranges (private, CGNAT, link-local, ULA, ...:
`policy.reserved.internal_ranges`) are refused, in audit mode too, unless a network rule that opts
into the range (`policy.reserved.opted_in`: not `0.0.0.0/0`) or the operator's allowance already
admits them: the same rule the rendered FORWARD chain applies to direct traffic. Openings
last as long as the answer's TTL (clamped), not the VM's life: a name that moves stops reaching
its old address once the guest has had time to look it up again. Connections already made stay up
(conntrack admits their replies); only new ones need a live opening.
"""

from __future__ import annotations

import logging
import re
import secrets
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import ip_address

from dnslib import QTYPE, RCODE, RR, A, DNSError, DNSRecord

from policy.blocklist import EMPTY, BlockList
from policy.model import DENY_ALL, Policy, Rule
from policy.reserved import internal_range_containing, opted_in
from runner.errors import NetworkError
from runner.net import addresses, netns
from runner.net.firewall import FirewallError
from runner.net.loop import NetLoop
from runner.net.secretswap import SecretSwap

log = logging.getLogger(__name__)

MAX_QUERY_BYTES = 512
MAX_TCP_QUERY_BYTES = 4096
MAX_ANSWERS = 16
MAX_OPENED_ADDRESSES = 256  # open at once per slot; expired ones free their place
MAX_NAMED_ADDRESSES = 1024  # addresses whose name the audit records can show; later ones show none
MAX_REFUSED_NAMES = 1024
MAX_NAMES_PER_ADDRESS = 32  # names one address was handed out for (a CDN edge serves many)
# Per slot, UDP and TCP together: enough for a job's parallel lookups (glibc asks A and AAAA at
# once, package managers resolve several hosts), since a dropped query costs the guest a 5 s retry.
# Every slot shares the loop's workers, so the cap stays below their number: one flooding guest
# always leaves workers for the other VMs. Several hostile guests
# together can still occupy every worker, but each query holds one for at most TCP_READ_TIMEOUT
# plus the upstream's timeout, so the others' lookups are delayed, never stalled for good.
MAX_IN_FLIGHT = 8
MAX_TTL = 300  # the longest TTL a guest is told: at most how long it keeps using an answer
# How long an answer's addresses stay open: its TTL, clamped. At least a minute, because a TTL of
# 0..30 s is common at load balancers and a client may use an answer a little past it (the JVM
# caches lookups for 30 s whatever the TTL; a lookup is often made well before its connection).
# At most an hour: however long the TTL it was served with, an address its name no longer points
# at (a moved or lapsed domain) closes within the hour unless a fresh lookup hands it out again.
# The guest is told min(ttl, MAX_TTL), never longer than the opening lasts (MAX_TTL <= MAX_OPEN_SECONDS).
MIN_OPEN_SECONDS = 60
MAX_OPEN_SECONDS = 3600
# How often the openings of every slot are checked for expiry between lookups (each answer also
# closes its slot's expired ones): an opening outlives its time by at most this. A check costs a
# dict scan per slot; the chain is only rewritten when something expired.
SWEEP_SECONDS = 2.0
# Rewrites of a slot's DNS allow chain that answers may cause. Each costs ~10 ms of iptables-restore
# under the host-wide xtables lock (every slot's policy load waits for it), and a name that resolves
# somewhere new on every lookup (a wildcard rule over a CDN, a DNS the attacker controls) would cost
# one per query: 256 back to back, then one per address that expired, for every hostile VM.
# A job's start-up burst of lookups fits in WRITE_BURST; past it WRITES_PER_SECOND refill. An answer
# that needs a new opening when none is left is SERVFAIL (the guest retries); one whose addresses
# are open already needs no write and is answered. Closing (`expire`) is never refused: it is
# bounded by the openings made and must not wait.
WRITE_BURST = 64
WRITES_PER_SECOND = 2
MAX_CNAME_HOPS = 8
TCP_READ_TIMEOUT = 2.0  # for a whole TCP query, not per recv: trickled bytes cannot hold a worker longer
_IP_FREEBIND = 15
_LABEL = re.compile(rb"[A-Za-z0-9_-]{1,63}")


@dataclass(frozen=True)
class Upstream:
    """Where allowed names are resolved; `netns` is the namespace its socket lives in (None: here)."""

    address: str
    port: int = 53
    netns: str | None = None
    timeout: float = 2.0

    @classmethod
    def from_resolv_conf(cls, path: str = "/etc/resolv.conf") -> Upstream:
        """The host's own first resolver, as production uses."""
        with open(path) as conf:
            for line in conf:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    return cls(parts[1])
        raise ValueError(f"{path} names no nameserver; configure the DNS upstream explicitly")

    def resolve(self, name: str, qtype: str) -> tuple[list[tuple[str, int]], int]:
        """(address, ttl) records of `qtype` for exactly `name`, and the upstream's rcode."""
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        sock = (
            netns.socket_in(self.netns, family, socket.SOCK_DGRAM)
            if self.netns
            else socket.socket(family, socket.SOCK_DGRAM)
        )
        with sock:
            sock.settimeout(self.timeout)
            query = DNSRecord.question(name, qtype)
            query.header.id = secrets.randbelow(65536)  # with the random source port: no off-path forgery
            sock.connect((self.address, self.port))
            sock.send(query.pack())
            deadline = time.monotonic() + self.timeout
            while True:  # skip stray datagrams, but only until the deadline
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                reply = DNSRecord.parse(sock.recv(4096))
                if reply.header.id == query.header.id:
                    break
        return _addresses_for(name, getattr(QTYPE, qtype), reply.rr), reply.header.rcode


def _addresses_for(name: str, rtype: int, answers: list[RR]) -> list[tuple[str, int]]:
    """(address, ttl) of `rtype` records for `name`, following the answer's CNAME chain (CDNs
    answer most names through one) but nothing else the upstream added."""
    aliases = {name}
    for _ in range(MAX_CNAME_HOPS):
        more = {_name(rr.rdata.label) for rr in answers if rr.rtype == QTYPE.CNAME and _name(rr.rname) in aliases}
        if more <= aliases:
            break
        aliases |= more
    found = [(str(rr.rdata), int(rr.ttl)) for rr in answers if rr.rtype == rtype and _name(rr.rname) in aliases]
    return found[:MAX_ANSWERS]


def _name(label: object) -> str:
    return str(label).rstrip(".").lower()


def valid_name(labels: tuple[bytes, ...]) -> bool:
    """A host name made of ordinary labels: anything else could never match a policy entry."""
    return bool(labels) and sum(len(label) + 1 for label in labels) <= 254 and all(_LABEL.fullmatch(label) for label in labels)


@dataclass(frozen=True, order=True)
class Opening:
    """One line group of the slot's DNS allow chain: `address` on `ports` of `protocol`.

    A `checked` opening (a name-checked host rule, `policy.model.Rule.name_checked`) is not
    accepted in the filter table but redirected to the name check (`runner.net.nameproxy`).
    In audit mode every answer also opens its address's other TCP ports that way, with no ports
    (`audited`): the name check then sees what each connection names, or that it names nothing,
    so the audit record (and the policy suggested from it) says what block mode would need."""

    address: str
    protocol: str
    ports: tuple[int, ...]
    checked: bool = False

    @property
    def audited(self) -> bool:
        """An audit-mode opening of every TCP port of `address` (after the rules' own)."""
        return not self.ports


# Rewrites the slot's whole DNS allow chain to hold exactly these openings, in one commit: an
# expiry then needs no rule deletion (which fails the whole commit when a rule is already gone).
ChainWriter = Callable[[list[Opening]], None]


@dataclass
class WriteBudget:
    """A token bucket of chain rewrites: `burst` at once, refilled at `per_second` (clock time)."""

    burst: float
    per_second: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, now: float) -> WriteBudget:
        return cls(WRITE_BURST, WRITES_PER_SECOND, WRITE_BURST, now)

    def take(self, now: float) -> bool:
        """Spend one rewrite at `now`; False (and nothing spent) when none is left."""
        self.tokens = min(self.burst, self.tokens + max(now - self.stamp, 0.0) * self.per_second)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def open_seconds(ttl: int) -> float:
    """How long an answer with `ttl` keeps its addresses open (see MIN/MAX_OPEN_SECONDS)."""
    return float(min(max(ttl, MIN_OPEN_SECONDS), MAX_OPEN_SECONDS))


@dataclass(eq=False)  # one object per slot: compared and hashed by identity
class SlotResolver:
    """One slot's DNS state: what it may resolve, what it has handed out and what is open.

    `openings` maps each rule of the slot's DNS allow chain to when it expires (`clock()` time):
    an answer opens its addresses until its TTL runs out (clamped), a later lookup of the name
    extends them, and `expire()` (run at every answer and by the service's periodic sweep) closes
    the rest. `allowances` are the operator's network rules, which let an answer through like an
    opting-in `cidr:` rule of the policy does (see `_screen`). `write_budget` bounds the rewrites answers
    cause (see WRITE_BURST); a released slot's next job starts with a full one.
    """

    netns: str
    write_chain: ChainWriter
    allowances: tuple[Rule, ...] = ()
    clock: Callable[[], float] = time.monotonic
    block_list: BlockList = EMPTY  # the operator's: refused in every mode, before any rule (policy.blocklist)
    policy: Policy = DENY_ALL
    generation: int = 0
    handed_out: dict[str, str] = field(default_factory=dict)
    names_at: dict[str, set[str]] = field(default_factory=dict)  # address -> every name it was handed out for
    refused: Counter[str] = field(default_factory=Counter)
    refused_answers: Counter[tuple[str, str]] = field(default_factory=Counter)  # (address, name)
    blocked: Counter[str] = field(default_factory=Counter)  # block-listed names asked, or answered into a blocked network
    # The job's bound secrets (runner.net.secretswap): a name spelling a placeholder is refused in
    # every mode and counted by binding name (the name itself is never recorded).
    bound_secrets: SecretSwap | None = None
    secret_refused: Counter[str] = field(default_factory=Counter)
    openings: dict[Opening, float] = field(default_factory=dict)
    sockets: list[socket.socket] = field(default_factory=list)
    in_flight: int = 0
    throttled: int = 0  # answers refused for want of write budget, this job
    write_budget: WriteBudget = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.write_budget = WriteBudget.full(self.clock())

    def configure(self, policy: Policy) -> None:
        """Take `policy`; the caller then reloads the slot's rules, which empties the DNS allow
        chain, so earlier openings are forgotten, and lookups still in flight open nothing."""
        with self.lock:
            self.policy = policy
            self.generation += 1
            self.openings.clear()

    def clear(self) -> None:
        """Forget everything: a released slot's next job starts from nothing."""
        with self.lock:
            self.policy = DENY_ALL
            self.generation += 1
            self.handed_out.clear()
            self.names_at.clear()
            self.refused.clear()
            self.refused_answers.clear()
            self.blocked.clear()
            self.bound_secrets = None
            self.secret_refused.clear()
            self.openings.clear()
            self.throttled = 0
            self.write_budget = WriteBudget.full(self.clock())

    def fence(self) -> None:
        """Never write again: the slot's namespace is about to go, and a new slot may take its name.
        Lookups in flight become stale and nothing is left for a sweep to close (waits for a write
        in progress, which then lands in the old namespace)."""
        with self.lock:
            self.generation += 1
            self.openings.clear()

    def snapshot(self) -> tuple[Policy, int]:
        with self.lock:
            return self.policy, self.generation

    def remember(self, name: str, records: list[tuple[str, int]], rules: tuple[Rule, ...],
                 generation: int) -> list[tuple[str, int]]:
        """Open what `rules` allow of the answer `records` for `name` until their TTL runs out,
        closing what has expired meanwhile; returns the records the guest may be handed.

        An address in an internal range (`policy.reserved.internal_ranges`) is refused, dropped from
        the answer and counted in `refused_answers`, in either mode, unless a network rule already
        lets the guest reach it on one of the rules' ports (see `_screen`).
        An answer that needs a new opening when the write budget is spent raises `Throttled`.
        The lock is held while the firewall is changed, so `clear()` (slot release) waits for an
        opening in flight, and an answer that outlived its job (older generation) opens nothing.
        """
        with self.lock:
            if generation != self.generation:
                raise StaleQuery(f"slot {self.netns} was released while resolving {name}")
            now = self.clock()
            live = {opening: expiry for opening, expiry in self.openings.items() if expiry > now}
            kept: list[tuple[str, int]] = []
            for address, ttl in records:
                if self.block_list.blocks_address(address):
                    self._count(self.blocked, name)
                    continue
                verdict = self._screen(address, rules)
                if verdict == _REFUSED:
                    self._note_refused_answer(name, address)
                    continue
                if verdict == _OPEN:
                    audited = (Opening(address, "tcp", (), True),) if self.policy.mode == "audit" else ()
                    for opening in (*(Opening(address, rule.protocol, tuple(sorted(rule.ports)), rule.name_checked)
                                      for rule in rules), *audited):
                        live[opening] = max(live.get(opening, 0.0), now + open_seconds(ttl))
                kept.append((address, ttl))
            if len({opening.address for opening in live}) > MAX_OPENED_ADDRESSES:
                raise OverflowError(f"slot {self.netns} has more than {MAX_OPENED_ADDRESSES} resolved addresses open")
            if not live.keys() <= self.openings.keys() and not self.write_budget.take(now):
                self.throttled += 1
                raise Throttled(f"slot {self.netns} opened new addresses faster than {WRITES_PER_SECOND}/s "
                                f"after a burst of {WRITE_BURST}; {name} was not answered")
            for address, _ in kept:
                if address in self.handed_out or len(self.handed_out) < MAX_NAMED_ADDRESSES:
                    self.handed_out[address] = name
                    names = self.names_at.setdefault(address, set())
                    if len(names) < MAX_NAMES_PER_ADDRESS:
                        names.add(name)
            self._commit(live)
            return kept

    def name_allowed(self, name: str, address: str, port: int) -> bool:
        """Whether a TCP connection to `address`:`port` that names `name` (TLS SNI, HTTP Host) is
        one the policy means: a name-checked rule allows `name` on `port`, this resolver handed
        `address` out for exactly `name`, and that opening is still live. `name` is normalised by
        the caller (`runner.net.namecheck.normalise_name`)."""
        with self.lock:
            if not any(rule.name_checked and rule.allows(port, "tcp", name=name) for rule in self.policy.rules):
                return False
            if name not in self.names_at.get(address, ()):
                return False
            now = self.clock()
            return any(opening.checked and opening.address == address and port in opening.ports and expiry > now
                       for opening, expiry in self.openings.items())

    def covers(self, name: str | None, port: int) -> bool:
        """Whether a name-checked rule of the policy allows `name` on `port` (None: no name, no rule)."""
        with self.lock:
            return name is not None and bool(self._request_rules(name, port))

    def handed_out_for(self, name: str, address: str) -> bool:
        """Whether this resolver handed `address` out for `name` (to this job)."""
        with self.lock:
            return name in self.names_at.get(address, ())

    def dialled_name(self, address: str) -> str | None:
        """The name this resolver last handed `address` out for, if any: what the guest dialled."""
        with self.lock:
            return self.handed_out.get(address)

    def _request_rules(self, name: str, port: int) -> list[Rule]:
        return [rule for rule in self.policy.rules if rule.name_checked and rule.allows(port, "tcp", name=name)]

    def request_allowed(self, name: str, port: int, method: str, path: str, *, body: bool,
                        overrides: tuple[str, ...], form: bool = False) -> bool:
        """Whether an HTTP request to `name`:`port` passes a rule's methods and paths (any rule for it;
        `Rule.allows_request` says what `body`, `overrides` and `form` are)."""
        with self.lock:
            return any(rule.allows_request(method, path, body=body, overrides=overrides, form=form)
                       for rule in self._request_rules(name, port))

    def intercepts(self, name: str, port: int) -> bool:
        """Whether HTTPS to `name`:`port` must be read request by request: every rule for it has
        methods or paths (one without them already admits any request, so nothing is intercepted)."""
        with self.lock:
            rules = self._request_rules(name, port)
            return bool(rules) and all(rule.intercepts for rule in rules)

    def name_blocked(self, name: str) -> bool:
        """Whether `name` is on the operator's block list (refused in every mode)."""
        return self.block_list.blocks_name(name)

    def secret_in(self, name: str) -> str | None:
        """The binding whose placeholder `name` spells (counted), or None."""
        with self.lock:
            misuse = self.bound_secrets.in_name(name) if self.bound_secrets is not None else None
            if misuse is not None:
                self._count(self.secret_refused, misuse.binding)
            return misuse.binding if misuse is not None else None

    def note_blocked(self, name: str) -> None:
        with self.lock:
            self._count(self.blocked, name)

    def _count(self, counter: Counter[str], name: str) -> None:
        """Count `name` in `counter` (call with the lock held), bounded like the refused names."""
        if name in counter or len(counter) < MAX_REFUSED_NAMES:
            counter[name] += 1

    def audit_only(self) -> bool:
        """Whether refusals are only recorded (audit mode) rather than enforced."""
        with self.lock:
            return self.policy.mode == "audit"

    def expire(self) -> None:
        """Close the openings whose time has run out (a failed write leaves them for the next try)."""
        with self.lock:
            now = self.clock()
            self._commit({opening: expiry for opening, expiry in self.openings.items() if expiry > now})

    def refused_answer_counts(self) -> list[tuple[str, int]]:
        """(name, count) of every name whose answers had internal addresses refused, counted per
        address: what the job's record may show. The addresses stay in the service log only, since
        the guest was refused them (see `runner.net.audit.refused_answer_record`)."""
        with self.lock:
            counts: Counter[str] = Counter()
            for (_, name), count in self.refused_answers.items():
                counts[name] += count
            return sorted(counts.items())

    def _commit(self, live: dict[Opening, float]) -> None:
        """Make `live` the slot's openings, rewriting the chain only when the set changed (a
        refreshed expiry alone changes no rule). Call with the lock held."""
        if live.keys() != self.openings.keys():
            self.write_chain(sorted(live))
        self.openings = live

    def _screen(self, address: str, rules: tuple[Rule, ...]) -> str:
        """_OPEN for an address the rules may open; for an internal one _COVERED when a network
        rule already admits it on one of the rules' ports, else _REFUSED. The rule is the rendered
        FORWARD chain's: the operator's allowances admit anything, the policy's `cidr:` rules only
        an address in a range they opt into (`opted_in`; never an always-denied one), so a broad
        `0.0.0.0/0` admits no LAN address here either."""
        parsed = ip_address(address)
        internal = internal_range_containing(parsed)
        if internal is None:
            return _OPEN
        networks = self.allowances
        if not internal.always_denied:
            networks = (*(rule for rule in self.policy.network_rules
                          if rule.network is not None and opted_in(rule.network)), *networks)
        covered = any(network.allows(port, rule.protocol, address=parsed)
                      for rule in rules for port in rule.ports for network in networks)
        return _COVERED if covered else _REFUSED

    def _note_refused_answer(self, name: str, address: str) -> None:
        """Count it; log only the first of each (address, name): the guest decides how often it asks."""
        key = (address, name)
        if key in self.refused_answers:
            self.refused_answers[key] += 1
        elif len(self.refused_answers) < MAX_REFUSED_NAMES:
            self.refused_answers[key] = 1
            log.info("refused %s for %s in %s: an internal address no network rule opts into (the job's "
                     "record shows the name only)", address, name, self.netns)

    def begin(self) -> bool:
        """Claim one of the slot's in-flight query places; False when all are taken."""
        with self.lock:
            if self.in_flight >= MAX_IN_FLIGHT:
                return False
            self.in_flight += 1
            return True

    def end(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def note_refused(self, name: str) -> None:
        with self.lock:
            if name in self.refused or len(self.refused) < MAX_REFUSED_NAMES:
                self.refused[name] += 1


_OPEN, _COVERED, _REFUSED = "open", "covered", "refused"


class StaleQuery(NetworkError):
    """The slot was released while its query was being resolved."""


class Throttled(NetworkError):
    """The answer needs a new opening and the slot's write budget is spent (see WRITE_BURST)."""


class DnsService:
    """Serves every slot's resolver from one loop; upstream lookups run on the loop's workers."""

    def __init__(self, loop: NetLoop, upstream: Upstream, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock` (seconds, monotonic) times the openings; tests pass one they can move."""
        if loop is not None and loop.workers <= MAX_IN_FLIGHT:
            raise ValueError(f"the DNS loop needs more than {MAX_IN_FLIGHT} workers (the per-slot cap), "
                             f"or one guest can take them all; it has {loop.workers}")
        self.loop = loop
        self.upstream = upstream
        self.clock = clock
        self._resolvers: set[SlotResolver] = set()
        self._lock = threading.Lock()
        self._sweeping = False
        if loop is not None:
            loop.every(SWEEP_SECONDS, self._start_sweep)

    def attach(self, ns: str, write_chain: ChainWriter, allowances: tuple[Rule, ...] = (),
               block_list: BlockList = EMPTY) -> SlotResolver:
        """Serve DNS in namespace `ns`; `write_chain` replaces its DNS allow chain, `allowances`
        are the operator's network rules, `block_list` the operator's block list (see `SlotResolver`)."""
        resolver = SlotResolver(ns, write_chain, tuple(allowances), self.clock, block_list)
        made: list[socket.socket] = []
        try:
            for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                sock = netns.socket_in(ns, socket.AF_INET, kind)
                made.append(sock)
                # FREEBIND: the gateway address may be (re)configured after the socket exists.
                sock.setsockopt(socket.SOL_IP, _IP_FREEBIND, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((addresses.DNS_IP, addresses.DNS_PORT))
            udp, tcp = made
            tcp.listen(8)
        except BaseException:
            for sock in made:  # they would pin the namespace the caller is about to remove
                sock.close()
            raise
        resolver.sockets = [udp, tcp]
        with self._lock:
            self._resolvers.add(resolver)
        self.loop.add_reader(udp, lambda s: self._on_udp(resolver, s))
        self.loop.add_reader(tcp, lambda s: self._on_tcp(resolver, s))
        return resolver

    def detach(self, resolver: SlotResolver) -> None:
        """Stop serving `resolver`'s slot; call before its namespace is removed (see `fence`)."""
        with self._lock:
            self._resolvers.discard(resolver)
        resolver.fence()
        for sock in resolver.sockets:
            self.loop.remove_reader(sock)
        resolver.sockets = []

    def sweep(self) -> None:
        """Close every slot's expired openings; one slot's failure leaves the others' sweep alone."""
        with self._lock:
            resolvers = list(self._resolvers)
        for resolver in resolvers:
            try:
                resolver.expire()
            except (FirewallError, OSError) as exc:
                log.warning("closing expired DNS openings of %s failed (retried at the next sweep): %s",
                            resolver.netns, exc)

    def _start_sweep(self) -> None:
        """On the loop thread: hand the sweep to a worker (it writes firewall rules), one at a time."""
        with self._lock:
            if self._sweeping:
                return
            self._sweeping = True

        def run() -> None:
            try:
                self.sweep()
            finally:
                with self._lock:
                    self._sweeping = False

        self.loop.submit(run)

    def _on_udp(self, resolver: SlotResolver, sock: socket.socket) -> None:
        try:
            data, peer = sock.recvfrom(MAX_QUERY_BYTES + 1)
        except BlockingIOError:
            return
        if len(data) > MAX_QUERY_BYTES:
            return  # oversized: no well-behaved stub sends this over UDP

        if not resolver.begin():
            return

        def work() -> None:
            try:
                answer = self._answer(resolver, data)
                if answer is not None:
                    sock.sendto(answer, peer)
            except OSError:
                pass
            finally:
                resolver.end()

        self.loop.submit(work)

    def _on_tcp(self, resolver: SlotResolver, sock: socket.socket) -> None:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return
        if not resolver.begin():
            conn.close()
            return
        self.loop.submit(lambda: self._serve_tcp(resolver, conn))

    def _serve_tcp(self, resolver: SlotResolver, conn: socket.socket) -> None:
        try:
            with conn:
                conn.setblocking(True)
                deadline = time.monotonic() + TCP_READ_TIMEOUT  # one deadline for the whole query
                (length,) = struct.unpack("!H", _read_exactly(conn, 2, deadline))
                if length > MAX_TCP_QUERY_BYTES:
                    return
                data = _read_exactly(conn, length, deadline)
                answer = self._answer(resolver, data)
                if answer is not None:
                    conn.settimeout(TCP_READ_TIMEOUT)  # the total for sendall, not per chunk
                    conn.sendall(struct.pack("!H", len(answer)) + answer)
        except (OSError, ValueError):
            return
        finally:
            resolver.end()

    def _answer(self, resolver: SlotResolver, data: bytes) -> bytes | None:
        """The reply to one guest query, or None when the packet is not worth one."""
        try:
            query = DNSRecord.parse(data)
        except (DNSError, struct.error, ValueError, IndexError):
            return None
        if query.header.qr or len(query.questions) != 1 or query.header.opcode != 0:
            return _error(query, RCODE.FORMERR)
        question = query.q
        if question.qclass != 1 or not valid_name(tuple(question.qname.label)):
            return _error(query, RCODE.REFUSED)
        name = _name(question.qname)
        qtype = QTYPE.get(question.qtype, str(question.qtype))
        if resolver.secret_in(name) is not None:  # a placeholder as labels: never asked upstream, in any mode
            return _error(query, RCODE.NXDOMAIN)
        if resolver.name_blocked(name):  # in every mode: the operator's list wins over any rule
            resolver.note_blocked(name)
            return _error(query, RCODE.NXDOMAIN)
        policy, generation = resolver.snapshot()
        rules = policy.rules_for_host(name)
        if not rules:
            resolver.note_refused(name)
            if policy.mode != "audit":
                return _error(query, RCODE.NXDOMAIN)
        if qtype == "AAAA":
            return _error(query, RCODE.NXDOMAIN)  # guests have no IPv6 address: never hand one out
        if qtype != "A":
            return _pack(query.reply())
        return self._resolve(resolver, query, name, rules, generation)

    def _resolve(
        self, resolver: SlotResolver, query: DNSRecord, name: str, rules: tuple[Rule, ...], generation: int
    ) -> bytes:
        """Ask upstream; in audit mode a refused name is resolved too but opens nothing. An
        answer whose every address was refused (internal, see `SlotResolver.remember`) is REFUSED,
        not an empty success: the guest's error then says the resolver would not, not that the
        name has no address."""
        try:
            records, rcode = self.upstream.resolve(name, "A")
            kept = resolver.remember(name, records, rules, generation)
        except Throttled as exc:
            if resolver.throttled == 1:  # once per job: the guest decides how often this happens
                log.warning("%s (further ones not logged)", exc)
            return _error(query, RCODE.SERVFAIL)
        except (OSError, DNSError, struct.error, ValueError, OverflowError, FirewallError, StaleQuery) as exc:
            log.warning("resolving %s for %s failed: %s", name, resolver.netns, exc)
            return _error(query, RCODE.SERVFAIL)
        if rcode != RCODE.NOERROR:
            return _error(query, rcode)
        if records and not kept:
            return _error(query, RCODE.REFUSED)
        records = kept
        answer = query.reply()
        for address, ttl in records:
            answer.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(address), ttl=min(ttl, MAX_TTL)))
        return _pack(answer)


def _error(query: DNSRecord, rcode: int) -> bytes:
    answer = query.reply()
    answer.header.rcode = rcode
    return _pack(answer)


def _pack(record: DNSRecord) -> bytes:
    """The record's wire form: dnslib publishes no types, so its pack() would be Any to mypy."""
    packed: bytes = record.pack()
    return packed


def _read_exactly(conn: socket.socket, size: int, deadline: float) -> bytes:
    """`size` bytes from `conn`, all of them before `deadline` (time.monotonic()), else TimeoutError."""
    data = b""
    while len(data) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the guest did not send its TCP query in time")
        conn.settimeout(remaining)
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("connection closed mid-query")
        data += chunk
    return data
