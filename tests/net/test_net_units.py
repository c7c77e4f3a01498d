"""Parts of the networking that need no namespace: guest packet parsing, policy suggestions, and
the resolver's decisions (against a fake upstream on loopback)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from ipaddress import ip_address, ip_network

import pytest
from dnslib import QTYPE, RCODE, DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from policy import Rule, load_policy
from policy.reserved import internal_range_containing
from policy.suggest import ALWAYS_DENIED, INTERNAL_ADDRESS, POLICY, REFUSED_DEST, AuditRecord, suggest_policy
from runner.net import Upstream
from runner.net import dns as dns_module
from runner.net.audit import parse_packet, payloads, refused_answer_record
from runner.net.dns import (
    MAX_IN_FLIGHT,
    MAX_OPEN_SECONDS,
    MAX_OPENED_ADDRESSES,
    MIN_OPEN_SECONDS,
    DnsService,
    Opening,
    SlotResolver,
    open_seconds,
)
from runner.net.firewall import FirewallError
from runner.net.loop import NetLoop
from tests.net.net_fakes import ALLOWED_HOST, LAN_HOST, METADATA, Clock, FrozenClock, Servers


def ipv4_packet(dest: str, proto: int, dport: int, header_words: int = 5) -> bytes:
    header = struct.pack("!BBHHHBBH4s4s", 0x40 | header_words, 0, 40, 0, 0, 64, proto, 0,
                         socket.inet_aton("192.0.2.2"), socket.inet_aton(dest))
    header += b"\0" * (4 * header_words - 20)
    return header + struct.pack("!HH", 40000, dport) + b"\0" * 16


def test_parse_packet_reads_destination_port_and_protocol() -> None:
    assert parse_packet(ipv4_packet("203.0.113.9", 6, 443)) == ("203.0.113.9", 443, "tcp")
    assert parse_packet(ipv4_packet("203.0.113.9", 17, 53, header_words=6)) == ("203.0.113.9", 53, "udp")
    assert parse_packet(ipv4_packet("203.0.113.9", 1, 0)) == ("203.0.113.9", None, "icmp")
    ipv6 = bytes([0x60]) + b"\0" * 5 + bytes([6, 64]) + b"\0" * 16 + socket.inet_pton(socket.AF_INET6, "2001:db8::1")
    assert parse_packet(ipv6 + struct.pack("!HH", 1, 8080)) == ("2001:db8::1", 8080, "tcp")


def test_truncated_packets_are_skipped() -> None:
    assert parse_packet(b"") is None
    assert parse_packet(ipv4_packet("203.0.113.9", 6, 443)[:19]) is None
    assert parse_packet(ipv4_packet("203.0.113.9", 6, 443)[:22]) == ("203.0.113.9", None, "tcp")


def nflog_message(packet: bytes, prefix: bytes | None, flags: int = 0) -> bytes:
    """One NFULNL_MSG_PACKET as the kernel frames it: nlmsghdr, nfgenmsg, then attributes (whose
    type may carry the NLA_F_NESTED / NLA_F_NET_BYTEORDER `flags`)."""
    def attribute(kind: int, value: bytes) -> bytes:
        raw = struct.pack("=HH", 4 + len(value), kind | flags) + value
        return raw + b"\0" * (-len(raw) % 4)

    body = struct.pack("=BBH", socket.AF_INET, 0, socket.htons(100))
    if prefix is not None:
        body += attribute(10, prefix + b"\0")
    body += attribute(9, packet)
    return struct.pack("=IHHII", 16 + len(body), 4 << 8, 0, 0, 0) + body


def test_nflog_prefix_tells_always_denied_hits_from_policy_blocks() -> None:
    metadata, web = ipv4_packet("169.254.169.254", 6, 80), ipv4_packet("203.0.113.9", 6, 443)
    lan = ipv4_packet(LAN_HOST, 6, 8000)
    datagram = (nflog_message(metadata, b"mvc!always-denied") + nflog_message(web, b"mvc:job-1")
                + nflog_message(web, None) + nflog_message(web, b"mvc!always-denied-not")
                + nflog_message(lan, b"mvc!internal-address"))
    assert payloads(datagram) == [(metadata, ALWAYS_DENIED), (web, POLICY), (web, POLICY), (web, POLICY),
                                  (lan, INTERNAL_ADDRESS)]


@pytest.mark.parametrize("flags", [0x4000, 0x8000, 0xC000])  # NLA_F_NET_BYTEORDER, NLA_F_NESTED
def test_attribute_flags_do_not_change_the_attribute_type(flags: int) -> None:
    metadata = ipv4_packet("169.254.169.254", 6, 80)
    assert payloads(nflog_message(metadata, b"mvc!always-denied", flags)) == [(metadata, ALWAYS_DENIED)]


@given(st.binary(max_size=300))
def test_hostile_bytes_never_break_the_audit_parsers(data: bytes) -> None:
    for payload, _ in payloads(data):
        parse_packet(payload)
    parse_packet(data)


def test_suggested_policy_allows_every_record_in_block_mode() -> None:
    records = [
        AuditRecord("203.0.113.10", 443, "tcp", "web.test", 3),
        AuditRecord("203.0.113.11", 80, "tcp", "web.test", 1),
        AuditRecord("203.0.113.20", 8000, "tcp", None, 1),
        AuditRecord("203.0.113.53", 53, "udp", None, 2),
        AuditRecord("2001:db8::1", 443, "tcp", None, 1),
        AuditRecord("203.0.113.20", None, "icmp", None, 5),
    ]

    text = suggest_policy(records)
    policy = load_policy(text, "suggested.yml")

    assert policy.mode == "block"
    for record in records[:5]:
        assert policy.allows(record.port, record.proto, name=record.name, address=record.dest), record
    assert not policy.allows(22, "tcp", address="203.0.113.20")
    assert "# not expressible in a policy, was attempted: icmp to 203.0.113.20" in text


def test_always_denied_attempts_are_reported_but_never_suggested() -> None:
    records = [AuditRecord("169.254.169.254", 80, "tcp", None, 2, ALWAYS_DENIED),
               AuditRecord("172.16.0.1", 22, "tcp", None, 1, ALWAYS_DENIED),
               AuditRecord("203.0.113.20", 8000, "tcp", None, 1)]

    text = suggest_policy(records)
    policy = load_policy(text, "suggested.yml")

    assert [rule.network and str(rule.network) for rule in policy.rules] == ["203.0.113.20/32"]
    assert not policy.allows(80, "tcp", address="169.254.169.254")
    assert "# always denied, no policy can allow it, was attempted: tcp to 169.254.169.254 port 80" in text
    assert "# always denied, no policy can allow it, was attempted: tcp to 172.16.0.1 port 22" in text
    assert records[0].to_wire()["reason"] == "always-denied" and records[2].to_wire()["reason"] == "policy"


def test_no_records_suggest_deny_all() -> None:
    assert load_policy(suggest_policy([]), "empty.yml").rules == ()


@pytest.fixture
def service() -> Iterator[tuple[DnsService, Servers]]:
    servers = Servers()
    port = servers.dns(None, "127.0.0.1", 0)
    loop = NetLoop()
    try:
        yield DnsService(loop, Upstream("127.0.0.1", port, timeout=2.0)), servers
    finally:
        loop.close()
        servers.close()


def resolver(policy_text: str, writes: list, clock: Clock | None = None) -> SlotResolver:  # type: ignore[type-arg]
    """A slot's resolver whose DNS allow chain is `writes[-1]` (every rewrite appended)."""
    slot = SlotResolver("unit", writes.append, clock=clock or Clock())
    slot.configure(load_policy(policy_text, "unit.yml"))
    return slot


WEB = "version: 1\nallow:\n  - host: web.test\n    ports: [443, 8000]\n"


def ask(service: DnsService, slot: SlotResolver, name: str, qtype: str = "A") -> DNSRecord:
    answer = service._answer(slot, DNSRecord.question(name, qtype).pack())
    assert answer is not None
    return DNSRecord.parse(answer)


def test_allowed_name_is_answered_and_opened_once(service) -> None:
    dns, upstream = service
    opened: list = []  # type: ignore[type-arg]
    slot = resolver(WEB, opened)

    first = ask(dns, slot, "WeB.test")  # resolvers randomise case (0x20)
    second = ask(dns, slot, "web.test")

    assert [str(rr.rdata) for rr in first.rr] == [ALLOWED_HOST]
    assert str(second.rr[0].rdata) == ALLOWED_HOST
    assert opened == [[Opening(ALLOWED_HOST, "tcp", (443, 8000), checked=True)]]  # the second only extends it
    assert slot.handed_out == {ALLOWED_HOST: "web.test"}
    assert upstream.queries == 2


def test_cname_chains_are_followed_but_unrelated_records_dropped(service) -> None:
    dns, _ = service
    opened: list = []  # type: ignore[type-arg]
    slot = resolver("version: 1\nallow:\n  - host: \"*.web.test\"\n    ports: [443]\n", opened)

    answer = ask(dns, slot, "files.web.test")

    assert [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]
    assert str(answer.rr[0].rname).rstrip(".") == "files.web.test"
    assert [opening.address for opening in opened[-1]] == [ALLOWED_HOST]


def test_names_that_are_not_host_names_are_refused(service) -> None:
    dns, upstream = service
    slot = resolver("version: 1\nallow:\n  - host: \"*.web.test\"\n    ports: [443]\n", [])
    query = DNSRecord.question("x.web.test")
    query.q.qname.label = (b"evil.x", b"web", b"test")  # a dot inside a label

    answer = DNSRecord.parse(dns._answer(slot, query.pack()))

    assert answer.header.rcode == RCODE.REFUSED and upstream.queries == 0


def test_refused_names_and_aaaa_never_reach_upstream(service) -> None:
    dns, upstream = service
    opened: list = []  # type: ignore[type-arg]
    slot = resolver(WEB, opened)

    assert ask(dns, slot, "denied.test").header.rcode == RCODE.NXDOMAIN
    assert ask(dns, slot, "web.test", "AAAA").header.rcode == RCODE.NXDOMAIN
    assert ask(dns, slot, "web.test.evil").header.rcode == RCODE.NXDOMAIN
    assert ask(dns, slot, "web.test", "TXT").rr == []
    assert upstream.queries == 0 and opened == []
    assert slot.refused["denied.test"] == 1


def test_audit_mode_answers_refused_names_but_opens_nothing_except_to_the_name_check(service) -> None:
    dns, _ = service
    opened: list = []  # type: ignore[type-arg]
    slot = resolver("version: 1\nmode: audit\n", opened)

    answer = ask(dns, slot, "denied.test")

    assert answer.header.rcode == RCODE.NOERROR and answer.rr[0].rtype == QTYPE.A
    # no rule accepts it; its TCP goes through the name check, which records what it names
    assert opened == [[Opening("203.0.113.20", "tcp", (), checked=True)]] and opened[0][0].audited
    assert slot.handed_out == {"203.0.113.20": "denied.test"}
    assert not slot.name_allowed("denied.test", "203.0.113.20", 8000)


def test_an_answer_that_outlives_its_job_opens_nothing(service) -> None:
    dns, _ = service
    opened: list = []  # type: ignore[type-arg]
    slot = resolver(WEB, opened)
    query = DNSRecord.question("web.test")
    policy, generation = slot.snapshot()
    slot.clear()  # the slot was released while the lookup was in flight

    answer = DNSRecord.parse(dns._resolve(slot, query, "web.test", policy.rules_for_host("web.test"), generation))

    assert answer.header.rcode == RCODE.SERVFAIL
    assert opened == [] and slot.handed_out == {}


def test_resolved_addresses_per_slot_are_bounded(service) -> None:
    dns, _ = service
    opened: list = []  # type: ignore[type-arg]
    slot = resolver(WEB, opened)
    far = slot.clock() + 3600
    slot.openings.update({Opening(f"198.51.{i // 256}.{i % 256}", "tcp", (443,)): far for i in range(MAX_OPENED_ADDRESSES)})

    assert ask(dns, slot, "web.test").header.rcode == RCODE.SERVFAIL
    assert opened == []


def test_a_trickled_tcp_query_holds_a_worker_only_until_one_deadline(service, monkeypatch) -> None:
    """The query trickles in over about 6 s, one byte every 0.2 s (each recv alone well within the 0.5 s
    timeout): the server must give up while most of it is still unsent. No clock is asserted: with a
    per-recv timeout the server would read every byte, and the sender would have sent them all."""
    dns, upstream = service
    monkeypatch.setattr(dns_module, "TCP_READ_TIMEOUT", 0.5)
    slot = resolver(WEB, [])
    query = DNSRecord.question("web.test").pack()
    message = struct.pack("!H", len(query)) + query
    guest, conn = socket.socketpair()
    stop = threading.Event()
    sent = 0

    def trickle() -> None:
        nonlocal sent
        for byte in message:
            if stop.wait(0.2):
                return
            try:
                guest.send(bytes([byte]))
            except OSError:
                return
            sent += 1

    sender = threading.Thread(target=trickle)
    sender.start()
    assert slot.begin()
    try:
        dns._serve_tcp(slot, conn)
        sent_when_it_gave_up = sent
    finally:
        stop.set()
        sender.join()
        guest.close()

    assert sent_when_it_gave_up < len(message) // 2, f"{sent_when_it_gave_up} of {len(message)} bytes read"
    assert upstream.queries == 0 and slot.in_flight == 0


def test_one_slot_cannot_take_every_dns_worker(service) -> None:
    dns, _ = service
    slot = resolver(WEB, [])

    assert all(slot.begin() for _ in range(MAX_IN_FLIGHT)) and not slot.begin()
    assert MAX_IN_FLIGHT < dns.loop.workers
    small = NetLoop(workers=MAX_IN_FLIGHT)
    try:
        with pytest.raises(ValueError, match="workers"):
            DnsService(small, dns.upstream)
    finally:
        small.close()


def test_attach_closes_its_sockets_when_it_fails(service, monkeypatch) -> None:
    dns, _ = service
    made: list[socket.socket] = []

    def socket_in(ns: str, family: int, kind: int, proto: int = 0) -> socket.socket:
        if made:
            raise OSError("no second socket")
        made.append(socket.socket(family, kind, proto))
        return made[-1]

    monkeypatch.setattr(dns_module.netns, "socket_in", socket_in)
    with pytest.raises(OSError, match="no second socket"):
        dns.attach("unit", lambda opened: None)

    assert [sock.fileno() for sock in made] == [-1]  # closed: an open one would pin the namespace


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_hostile_queries_get_an_answer_or_nothing(data: bytes) -> None:
    slot = resolver(WEB, [])
    dns = DnsService(loop=None, upstream=Upstream("127.0.0.1", 9, timeout=0.01))  # type: ignore[arg-type]
    answer = dns._answer(slot, data)
    assert answer is None or DNSRecord.parse(answer).header.qr == 1


LAN = "version: 1\nallow:\n  - host: lan.test\n    ports: [8000]\n"


@pytest.mark.parametrize("address", ["10.0.0.5", "172.16.3.4", "192.168.1.1", "100.64.0.1", "100.127.255.254",
                                     "169.254.169.254", "127.0.0.1", "0.1.2.3", "224.0.0.251", "240.0.0.1",
                                     "255.255.255.255", "198.18.0.1", "192.0.0.8", "fd12::1", "fe80::1", "::1",
                                     "::ffff:10.0.0.5",
                                     # IPv6 forms that carry an internal IPv4 address a gateway may reach:
                                     "64:ff9b::10.0.0.5", "::10.0.0.5", "2002:a00:5::1", "2002:c0a8:101::1",
                                     "2001:0:4136:e378:8000:63bf:f5ff:fffa"])  # Teredo, client 10.0.0.5
def test_internal_ranges(address: str) -> None:
    assert internal_range_containing(ip_address(address)) is not None


@pytest.mark.parametrize("address", ["203.0.113.10", "198.51.100.1", "192.0.2.10", "8.8.8.8", "100.128.0.1",
                                     "172.32.0.1", "11.0.0.1", "2001:db8::1", "2606:4700::1",
                                     "64:ff9b::808:808", "2002:808:808::1"])
def test_public_looking_ranges(address: str) -> None:
    assert internal_range_containing(ip_address(address)) is None


def test_an_allowed_name_answered_with_a_private_address_is_refused(service) -> None:
    dns, _ = service
    writes: list = []  # type: ignore[type-arg]
    slot = resolver(LAN, writes)

    answer = ask(dns, slot, "lan.test")

    assert answer.header.rcode == RCODE.REFUSED and answer.rr == []
    assert writes == [] and slot.handed_out == {}
    assert slot.refused_answer_counts() == [("lan.test", 1)]


def test_only_the_internal_addresses_of_an_answer_are_dropped(service) -> None:
    dns, _ = service
    writes: list = []  # type: ignore[type-arg]
    slot = resolver("version: 1\nallow:\n  - host: mixed.test\n    ports: [8000]\n", writes)

    answer = ask(dns, slot, "mixed.test")

    assert answer.header.rcode == RCODE.NOERROR and [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]
    assert writes == [[Opening(ALLOWED_HOST, "tcp", (8000,), checked=True)]]
    assert slot.refused_answer_counts() == [("mixed.test", 1)]


@pytest.mark.parametrize("cidr, ports, handed_out", [("10.0.0.0/24", "[8000]", True), ("10.0.0.5/32", "[8000, 9000]", True),
                                                    ("10.0.0.0/24", "[9000]", False), ("10.0.1.0/24", "[8000]", False)])
def test_a_cidr_rule_covering_the_address_and_port_lets_it_through(service, cidr: str, ports: str, handed_out: bool) -> None:
    dns, _ = service
    writes: list = []  # type: ignore[type-arg]
    slot = resolver(LAN + f"  - cidr: {cidr}\n    ports: {ports}\n", writes)

    answer = ask(dns, slot, "lan.test")

    assert ([str(rr.rdata) for rr in answer.rr] == [LAN_HOST]) is handed_out
    assert writes == []  # the cidr rule admits it already: nothing to open, nothing to expire
    assert (slot.refused_answer_counts() == []) is handed_out


def test_always_denied_answers_pass_only_an_operator_allowance(service) -> None:
    dns, _ = service
    rebind = "version: 1\nallow:\n  - host: rebind.test\n    ports: [80]\n  - cidr: 0.0.0.0/0\n    ports: [80]\n"
    slot = resolver(rebind, [])
    assert ask(dns, slot, "rebind.test").header.rcode == RCODE.REFUSED  # no policy can open the metadata service

    operator = (Rule(frozenset({80}), network=ip_network(f"{METADATA}/32")),)
    allowed = SlotResolver("unit", [].append, allowances=operator)
    allowed.configure(load_policy(rebind, "unit.yml"))
    assert [str(rr.rdata) for rr in ask(dns, allowed, "rebind.test").rr] == [METADATA]


@pytest.mark.parametrize("allow", ["  - host: lan.test\n    ports: [8000]\n", ""])  # allowed or not: audit asks either way
def test_audit_mode_refuses_internal_answers_too(service, allow: str) -> None:
    """Audit mode lets public egress through to see what block mode would stop; it never opens the LAN."""
    dns, _ = service
    writes: list = []  # type: ignore[type-arg]
    slot = resolver(f"version: 1\nmode: audit\nallow:\n{allow or '  []'}\n", writes)

    answer = ask(dns, slot, "lan.test")

    assert answer.header.rcode == RCODE.REFUSED and answer.rr == [] and writes == []
    assert slot.handed_out == {} and slot.refused_answer_counts() == [("lan.test", 1)]


@pytest.mark.parametrize("mode", ["block", "audit"])
@pytest.mark.parametrize("cidr, handed_out", [("0.0.0.0/0", False), ("8.0.0.0/6", False), ("10.0.0.0/7", False),
                                             ("10.0.0.0/8", True), ("10.0.0.0/24", True)])
def test_only_a_cidr_rule_inside_the_internal_range_opts_into_it(service, mode: str, cidr: str, handed_out: bool) -> None:
    """A rule for the whole internet (or any range wider than the private one it overlaps) is meant
    for the internet: it does not make an allowed name's LAN answer reachable, in either mode."""
    dns, _ = service
    slot = resolver(f"version: 1\nmode: {mode}\n" + LAN.split("\n", 1)[1] + f"  - cidr: {cidr}\n    ports: [8000]\n", [])

    answer = ask(dns, slot, "lan.test")

    assert ([str(rr.rdata) for rr in answer.rr] == [LAN_HOST]) is handed_out
    assert (answer.header.rcode == RCODE.REFUSED) is not handed_out


def test_open_seconds_are_the_ttl_clamped() -> None:
    assert open_seconds(0) == MIN_OPEN_SECONDS == 60
    assert open_seconds(300) == 300
    assert open_seconds(7 * 86400) == MAX_OPEN_SECONDS == 3600
    assert dns_module.MAX_TTL <= MAX_OPEN_SECONDS  # a guest is never told to use an answer longer than it is open


def test_openings_expire_with_their_ttl_and_a_lookup_extends_them(service) -> None:
    dns, _ = service
    clock, writes = Clock(), []  # type: ignore[var-annotated]
    slot = resolver(WEB, writes, clock)
    web = [Opening(ALLOWED_HOST, "tcp", (443, 8000), checked=True)]

    ask(dns, slot, "web.test")  # the fake upstream's TTL is 60 s
    clock.advance(50)
    ask(dns, slot, "web.test")  # open until 110 s now
    clock.advance(15)
    slot.expire()
    assert writes == [web]
    clock.advance(50)
    slot.expire()
    assert writes == [web, []]  # closed, without a lookup
    ask(dns, slot, "web.test")
    assert writes == [web, [], web]  # and opened again by the next one


def test_each_answer_also_closes_what_has_expired(service) -> None:
    dns, _ = service
    clock, writes = Clock(), []  # type: ignore[var-annotated]
    slot = resolver(WEB + '  - host: "*.cdn.test"\n    ports: [9000]\n', writes, clock)

    ask(dns, slot, "web.test")
    clock.advance(61)
    ask(dns, slot, "a.cdn.test")  # same address, another rule: web.test's opening is gone in the same write

    assert writes[-1] == [Opening(ALLOWED_HOST, "tcp", (9000,), checked=True)]


def test_a_failed_expiry_is_retried_and_other_slots_are_still_swept(service, monkeypatch) -> None:
    dns, _ = service
    monkeypatch.setattr(dns_module.netns, "socket_in", lambda ns, family, kind, proto=0: socket.socket(family, kind, proto))
    monkeypatch.setattr(dns_module.addresses, "DNS_IP", "127.0.0.1")
    monkeypatch.setattr(dns_module.addresses, "DNS_PORT", 0)
    clock = Clock()
    dns.clock = clock
    failing, good = [], []  # type: ignore[var-annotated]

    def refuse(openings: list) -> None:  # type: ignore[type-arg]
        failing.append(openings)
        if len(failing) > 1:
            raise FirewallError("iptables-restore rejected the rules")

    slots = [dns.attach("bad", refuse), dns.attach("good", good.append)]
    try:
        for slot in slots:
            slot.configure(load_policy(WEB, "unit.yml"))
            ask(dns, slot, "web.test")
        clock.advance(61)
        dns.sweep()
        assert good[-1] == [] and len(slots[0].openings) == 1  # kept, to be closed at the next sweep
    finally:
        for slot in slots:
            dns.detach(slot)


def test_the_loop_runs_periodic_callbacks_on_its_thread() -> None:
    loop = NetLoop(workers=1)
    ran = threading.Event()
    threads: list[str] = []
    try:
        loop.every(0.05, lambda: (threads.append(threading.current_thread().name), ran.set()))
        assert ran.wait(5)
    finally:
        loop.close()
    assert threads[0] == "mvc-netloop"
    with pytest.raises(ValueError, match="positive interval"):
        loop.every(0, lambda: None)


def test_internal_addresses_are_suggested_as_a_comment_only() -> None:
    records = [refused_answer_record("lan.test", 2), AuditRecord("203.0.113.20", 8000, "tcp", None, 1),
               AuditRecord(LAN_HOST, 8000, "tcp", "lan.test", 1, INTERNAL_ADDRESS)]

    text = suggest_policy(records)

    assert [str(rule.network) for rule in load_policy(text, "suggested.yml").rules] == ["203.0.113.20/32"]
    assert "# lan.test resolved to an internal address, refused" in text
    assert f"# an internal address, refused in every mode, was attempted: tcp to {LAN_HOST} port 8000" in text
    assert records[0].to_wire() == {"dest": REFUSED_DEST, "port": None, "proto": "dns", "name": "lan.test", "count": 2,
                                    "reason": INTERNAL_ADDRESS}


def test_a_name_that_resolves_somewhere_new_every_time_cannot_flood_the_firewall() -> None:
    """Attack: a wildcard rule over a CDN (or a DNS the attacker controls) answers each lookup with
    a new address, so every answer would rewrite the chain (~10 ms of iptables-restore under the
    host-wide xtables lock). Rewrites caused by answers stay within the slot's write budget."""
    clock, writes = FrozenClock(), []  # type: ignore[var-annotated]
    slot = resolver("version: 1\nallow:\n  - host: \"*.cdn.test\"\n    ports: [443]\n", writes, clock)
    rules = slot.policy.rules_for_host("a.cdn.test")
    throttled = 0

    def flood(count: int, first: int) -> None:
        nonlocal throttled
        for i in range(first, first + count):
            try:
                slot.remember(f"n{i}.cdn.test", [(f"198.51.{i // 200}.{i % 200 + 1}", 0)], rules, slot.generation)
            except dns_module.Throttled:
                throttled += 1

    flood(1000, 0)
    assert len(writes) == dns_module.WRITE_BURST and throttled == 1000 - dns_module.WRITE_BURST
    clock.advance(10)
    flood(100, 1000)
    assert len(writes) == dns_module.WRITE_BURST + 10 * dns_module.WRITES_PER_SECOND


def test_a_throttled_slot_still_answers_what_is_already_open_and_recovers(service) -> None:
    dns, _ = service
    clock, writes = FrozenClock(), []  # type: ignore[var-annotated]
    slot = resolver(WEB + '  - host: "*.cdn.test"\n    ports: [9000]\n', writes, clock)
    ask(dns, slot, "web.test")
    slot.write_budget.tokens = 0.0  # spent by a flood of new addresses

    assert [str(rr.rdata) for rr in ask(dns, slot, "web.test").rr] == [ALLOWED_HOST]  # open already: no write
    assert ask(dns, slot, "a.cdn.test").header.rcode == RCODE.SERVFAIL  # a new opening: over budget
    assert len(writes) == 1
    clock.advance(1 / dns_module.WRITES_PER_SECOND)
    assert ask(dns, slot, "a.cdn.test").header.rcode == RCODE.NOERROR
    assert len(writes) == 2


def test_repeated_internal_answers_are_counted_but_logged_once(service, caplog) -> None:
    """Attack: a guest asking for an internally-answered name in a loop turns each query into a
    service log line; the count goes to the job's record, the log gets the first one only."""
    dns, _ = service
    slot = resolver(LAN, [])
    with caplog.at_level("INFO", logger="runner.net.dns"):
        for _ in range(5):
            assert ask(dns, slot, "lan.test").header.rcode == RCODE.REFUSED

    assert slot.refused_answer_counts() == [("lan.test", 5)]
    assert len([r for r in caplog.records if LAN_HOST in r.getMessage()]) == 1


def test_a_detached_resolver_never_writes_again(service, monkeypatch) -> None:
    """Attack: a lookup (or a sweep) still running when its slot is destroyed would write the old
    job's openings into whatever namespace has that name by then: the next slot made at the same
    index. Detaching fences the resolver; it writes nothing afterwards."""
    dns, _ = service
    monkeypatch.setattr(dns_module.netns, "socket_in", lambda ns, family, kind, proto=0: socket.socket(family, kind, proto))
    monkeypatch.setattr(dns_module.addresses, "DNS_IP", "127.0.0.1")
    monkeypatch.setattr(dns_module.addresses, "DNS_PORT", 0)
    clock, writes = Clock(), []  # type: ignore[var-annotated]
    dns.clock = clock
    slot = dns.attach("old", writes.append)
    slot.configure(load_policy(WEB, "unit.yml"))
    ask(dns, slot, "web.test")
    policy, generation = slot.snapshot()  # a second lookup, in flight while the slot goes away

    dns.detach(slot)
    with pytest.raises(dns_module.StaleQuery, match="released"):
        slot.remember("web.test", [("198.51.100.7", 60)], policy.rules_for_host("web.test"), generation)
    clock.advance(61)
    slot.expire()

    assert writes == [[Opening(ALLOWED_HOST, "tcp", (443, 8000), checked=True)]]
