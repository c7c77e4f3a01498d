"""The guests' resolver: answers only names the slot's policy allows, and opens what it hands out.

Each slot has UDP and TCP sockets on 192.0.2.1:53 inside its namespace; one `NetLoop` thread
serves them all. A guest query is never forwarded as-is: the resolver asks the upstream a fresh
question of its own (so nothing the guest puts in a packet reaches the upstream but the name), keeps
only the address records for that name, opens exactly those addresses on the rule's ports in the
slot's allow chain, and only then answers, so the guest's first connection is already allowed.
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
from dataclasses import dataclass, field
from typing import Callable

from dnslib import QTYPE, RCODE, RR, A, DNSError, DNSRecord

from policy.model import DENY_ALL, Policy, Rule

from runner.net import addresses, netns
from runner.net.firewall import FirewallError
from runner.net.loop import NetLoop

log = logging.getLogger(__name__)

MAX_QUERY_BYTES = 512
MAX_TCP_QUERY_BYTES = 4096
MAX_ANSWERS = 16
MAX_OPENED_ADDRESSES = 256
MAX_REFUSED_NAMES = 1024
# Per slot, UDP and TCP together: enough for a job's parallel lookups (glibc asks A and AAAA at
# once, package managers resolve several hosts), since a dropped query costs the guest a 5 s retry.
# Every slot shares the loop's workers, so the cap stays below their number: one flooding guest
# always leaves workers for the other VMs. Several hostile guests
# together can still occupy every worker, but each query holds one for at most TCP_READ_TIMEOUT
# plus the upstream's timeout, so the others' lookups are delayed, never stalled for good.
MAX_IN_FLIGHT = 8
MAX_TTL = 300
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
    def from_resolv_conf(cls, path: str = "/etc/resolv.conf") -> "Upstream":
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


Opener = Callable[[list[tuple[str, Rule]]], None]


@dataclass
class SlotResolver:
    """One slot's DNS state: what it may resolve and what it has been handed."""

    netns: str
    open_addresses: Opener
    policy: Policy = DENY_ALL
    generation: int = 0
    handed_out: dict[str, str] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)
    opened: set[tuple[str, int, str]] = field(default_factory=set)
    sockets: list[socket.socket] = field(default_factory=list)
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def configure(self, policy: Policy) -> None:
        with self.lock:
            self.policy = policy

    def clear(self) -> None:
        """Forget everything: a released slot's next job starts from nothing."""
        with self.lock:
            self.policy = DENY_ALL
            self.generation += 1
            self.handed_out.clear()
            self.refused.clear()
            self.opened.clear()

    def snapshot(self) -> tuple[Policy, int]:
        with self.lock:
            return self.policy, self.generation

    def remember(self, name: str, records: list[tuple[str, int]], rules: tuple[Rule, ...], generation: int) -> None:
        """Record the hand-out and open what `rules` allow for it (bounded per slot).

        The lock is held while the firewall is changed, so `clear()` (slot release) waits for an
        opening in flight, and an answer that outlived its job (older generation) opens nothing.
        """
        with self.lock:
            if generation != self.generation:
                raise StaleQuery(f"slot {self.netns} was released while resolving {name}")
            fresh: list[tuple[str, Rule]] = []
            for address, _ttl in records:
                if address not in self.handed_out and len(self.handed_out) >= MAX_OPENED_ADDRESSES:
                    raise OverflowError(f"slot {self.netns} reached {MAX_OPENED_ADDRESSES} resolved addresses")
                self.handed_out[address] = name
                for rule in rules:
                    keys = {(address, port, rule.protocol) for port in rule.ports}
                    if not keys <= self.opened:
                        fresh.append((address, rule))
                        self.opened |= keys
            if not fresh:
                return
            try:
                self.open_addresses(fresh)
            except Exception:  # not opened after all: let the next lookup try again
                for address, rule in fresh:
                    self.opened -= {(address, port, rule.protocol) for port in rule.ports}
                raise

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


class StaleQuery(RuntimeError):
    """The slot was released while its query was being resolved."""


class DnsService:
    """Serves every slot's resolver from one loop; upstream lookups run on the loop's workers."""

    def __init__(self, loop: NetLoop, upstream: Upstream) -> None:
        if loop is not None and loop.workers <= MAX_IN_FLIGHT:
            raise ValueError(f"the DNS loop needs more than {MAX_IN_FLIGHT} workers (the per-slot cap), "
                             f"or one guest can take them all; it has {loop.workers}")
        self.loop = loop
        self.upstream = upstream

    def attach(self, ns: str, opener: Opener) -> SlotResolver:
        resolver = SlotResolver(ns, opener)
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
        self.loop.add_reader(udp, lambda s: self._on_udp(resolver, s))
        self.loop.add_reader(tcp, lambda s: self._on_tcp(resolver, s))
        return resolver

    def detach(self, resolver: SlotResolver) -> None:
        for sock in resolver.sockets:
            self.loop.remove_reader(sock)
        resolver.sockets = []

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
        policy, generation = resolver.snapshot()
        rules = policy.rules_for_host(name)
        if not rules:
            resolver.note_refused(name)
            if policy.mode != "audit":
                return _error(query, RCODE.NXDOMAIN)
        if qtype == "AAAA":
            return _error(query, RCODE.NXDOMAIN)  # guests have no IPv6 address: never hand one out
        if qtype != "A":
            return query.reply().pack()
        return self._resolve(resolver, query, name, rules, generation)

    def _resolve(
        self, resolver: SlotResolver, query: DNSRecord, name: str, rules: tuple[Rule, ...], generation: int
    ) -> bytes:
        """Ask upstream; in audit mode a refused name is resolved too but opens nothing."""
        try:
            records, rcode = self.upstream.resolve(name, "A")
            resolver.remember(name, records, rules, generation)
        except (OSError, DNSError, struct.error, ValueError, OverflowError, FirewallError, StaleQuery) as exc:
            log.warning("resolving %s for %s failed: %s", name, resolver.netns, exc)
            return _error(query, RCODE.SERVFAIL)
        if rcode != RCODE.NOERROR:
            return _error(query, rcode)
        answer = query.reply()
        for address, ttl in records:
            answer.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(address), ttl=min(ttl, MAX_TTL)))
        return answer.pack()


def _error(query: DNSRecord, rcode: int) -> bytes:
    answer = query.reply()
    answer.header.rcode = rcode
    return answer.pack()


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
