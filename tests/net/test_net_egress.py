"""Egress through a slot: the policy's hosts are reachable, nothing else is."""

from __future__ import annotations

import subprocess
from contextlib import ExitStack
from ipaddress import ip_network

import pytest
from dnslib import QTYPE, RCODE

import tests.net.net_fakes as net_fakes
from policy import OperatorAllowances, Rule, load_policy
from policy.suggest import ALWAYS_DENIED, POLICY
from runner.net import NamespaceUplink, SlotPool, Upstream, addresses, netns
from tests.net.net_fakes import ALLOWED_HOST, DENIED_HOST, METADATA, ip, lookup, reach

WEB_POLICY = """\
version: 1
mode: block
allow:
  - host: web.test
    ports: [8000]
"""


def policy(text: str):  # type: ignore[no-untyped-def]
    return load_policy(text, "test-policy.yml")


def test_pooled_slot_denies_everything(slot, guest) -> None:
    assert not reach(guest, ALLOWED_HOST, 8000, name="web.test")
    assert lookup(guest, "web.test") is None  # even the resolver is closed until a policy is loaded


def test_allowed_name_opens_only_its_port(slot, guest) -> None:
    slot.apply_policy(policy(WEB_POLICY))
    assert not reach(guest, ALLOWED_HOST, 8000, name="web.test")  # not handed out by the resolver yet

    answer = lookup(guest, "web.test")

    assert answer is not None and answer.header.rcode == RCODE.NOERROR
    assert [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
    assert not reach(guest, ALLOWED_HOST, 9000, name="web.test")
    assert not reach(guest, DENIED_HOST, 8000)


def test_disallowed_name_and_every_aaaa_get_nxdomain(slot, guest) -> None:
    slot.apply_policy(policy(WEB_POLICY))

    denied = lookup(guest, "denied.test")
    aaaa = lookup(guest, "web.test", "AAAA")

    assert denied is not None and denied.header.rcode == RCODE.NXDOMAIN
    assert aaaa is not None and aaaa.header.rcode == RCODE.NXDOMAIN
    assert not reach(guest, DENIED_HOST, 8000)


def test_wildcard_and_tcp_queries(slot, guest) -> None:
    slot.apply_policy(policy(WEB_POLICY + '  - host: "*.cdn.test"\n    ports: [9000]\n'))

    answer = lookup(guest, "A.CDN.test", tcp=True)

    assert answer is not None and [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]
    assert answer.rr[0].rtype == QTYPE.A
    assert reach(guest, ALLOWED_HOST, 9000, name="a.cdn.test")
    bare = lookup(guest, "cdn.test")
    assert bare is not None and bare.header.rcode == RCODE.NXDOMAIN


def test_cidr_rule_is_clipped_at_metadata_gateway_and_uplink(net, slot, guest) -> None:
    net_fakes_tcp = net_fakes.Servers()
    gateway_port = 2222
    try:
        net_fakes_tcp.tcp(slot.netns, "0.0.0.0", gateway_port)  # the namespace itself, all addresses
        net_fakes_tcp.tcp(net.internet, addresses.uplink_ip(slot.index), 8000)
        slot.apply_policy(policy("version: 1\nmode: block\nallow:\n  - cidr: 0.0.0.0/0\n    ports: [80, 8000, 2222]\n"))

        assert reach(guest, DENIED_HOST, 8000)  # the wide rule works ...
        assert not reach(guest, METADATA, 80)  # ... but never for the metadata service,
        assert not reach(guest, addresses.GATEWAY_IP, gateway_port)  # the gateway,
        assert not reach(guest, addresses.veth_ip(slot.index), gateway_port)  # the slot's own uplink address
        assert not reach(guest, addresses.uplink_ip(slot.index), 8000)  # or the uplink's

        records = {(r.dest, r.port, r.proto): r.reason for r in slot.audit_records()}
        assert records == {  # each attempt is reported, as something no policy can allow
            (METADATA, 80, "tcp"): ALWAYS_DENIED,
            (addresses.GATEWAY_IP, gateway_port, "tcp"): ALWAYS_DENIED,
            (addresses.veth_ip(slot.index), gateway_port, "tcp"): ALWAYS_DENIED,
            (addresses.uplink_ip(slot.index), 8000, "tcp"): ALWAYS_DENIED,
        }
    finally:
        net_fakes_tcp.close()


def test_always_denied_stays_denied_and_reported_in_audit_mode(slot, guest) -> None:
    slot.apply_policy(policy("version: 1\nmode: audit\nallow: []\n"))

    assert reach(guest, DENIED_HOST, 8000)  # audit lets the policy's blocks through ...
    assert not reach(guest, METADATA, 80)  # ... never the always-denied ones

    assert {(r.dest, r.port, r.reason) for r in slot.audit_records()} == {
        (DENIED_HOST, 8000, POLICY), (METADATA, 80, ALWAYS_DENIED)}


def test_spoofed_source_ip_is_dropped(slot, guest) -> None:
    slot.apply_policy(policy("version: 1\nmode: block\nallow:\n  - cidr: 203.0.113.0/24\n    ports: [8000]\n"))
    ip("-n", guest, "addr", "add", "10.9.9.9/32", "dev", "eth0")

    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
    assert not reach(guest, ALLOWED_HOST, 8000, source="10.9.9.9")


def test_spoofed_mac_is_dropped(slot, guest) -> None:
    slot.apply_policy(policy("version: 1\nmode: block\nallow:\n  - cidr: 203.0.113.0/24\n    ports: [8000]\n"))

    def use_mac(mac: str) -> None:
        ip("-n", guest, "link", "set", "eth0", "address", mac)
        ip("-n", slot.netns, "neigh", "flush", "dev", addresses.TAP_NAME)  # let the slot learn it afresh

    use_mac("52:54:00:00:00:99")
    assert not reach(guest, ALLOWED_HOST, 8000, name="web.test")
    use_mac(addresses.GUEST_MAC)
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")


def test_ipv6_is_blocked(slot, guest, net) -> None:
    """Give the test topology a working IPv6 path, prove it works without rules, then apply a policy."""
    from tests.net.net_fakes import SERVER_IP6

    ip("-n", guest, "-6", "addr", "add", "2001:db8:1::2/64", "dev", "eth0", "nodad")
    ip("-n", guest, "-6", "route", "add", "default", "via", "2001:db8:1::1")
    ip("-n", slot.netns, "-6", "addr", "add", "2001:db8:1::1/64", "dev", addresses.TAP_NAME, "nodad")
    ip("-n", slot.netns, "-6", "addr", "add", "2001:db8:2::2/64", "dev", addresses.VETH_NAME, "nodad")
    ip("-n", slot.netns, "-6", "route", "add", "default", "via", "2001:db8:2::1")
    ip("-n", net.internet, "-6", "addr", "add", "2001:db8:2::1/64", "dev", slot.netns, "nodad")
    ip("-n", net.internet, "-6", "route", "add", "2001:db8:1::/64", "via", "2001:db8:2::2")
    subprocess.run(["ip", "netns", "exec", slot.netns, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"], check=True)
    open_doc = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n"
    slot.firewall.load(slot.netns, open_doc, ipv6=True)  # behind the slot's back, so:
    assert reach(guest, SERVER_IP6, 8000, timeout=5)  # the path works when nothing filters it (slow ND)
    net.pool.release(slot)  # release restores the IPv6 deny-all whatever happened to it
    slot = net.pool.acquire()

    slot.apply_policy(policy("version: 1\nmode: block\nallow:\n  - cidr: 203.0.113.0/24\n    ports: [8000]\n"))

    assert not reach(guest, SERVER_IP6, 8000)
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")


@pytest.mark.parametrize("bad", [b"", b"\x00" * 11, b"\xff" * 600, b"garbage that is not dns"])
def test_malformed_queries_are_ignored_and_service_goes_on(slot, guest, bad: bytes) -> None:
    import socket

    from tests.net.net_fakes import in_ns

    slot.apply_policy(policy(WEB_POLICY))

    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.sendto(bad, (addresses.DNS_IP, addresses.DNS_PORT))

    in_ns(guest, send)
    answer = lookup(guest, "web.test")
    assert answer is not None and [str(rr.rdata) for rr in answer.rr] == [ALLOWED_HOST]


def test_the_slot_namespace_itself_reaches_nothing_upstream(slot, guest) -> None:
    """QEMU runs in the slot's namespace: a process escaping the guest into it gains no network."""
    slot.apply_policy(policy("version: 1\nmode: block\nallow:\n  - cidr: 203.0.113.0/24\n    ports: [8000]\n"))

    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
    assert not reach(slot.netns, ALLOWED_HOST, 8000)
    assert not reach(slot.netns, addresses.uplink_ip(slot.index), 8000)


def test_nothing_on_the_uplink_side_reaches_into_the_slot(net, slot, guest) -> None:
    """Whoever sits on the uplink (the host, a neighbour) reaches neither the slot's sockets nor its resolver."""
    servers = net_fakes.Servers()
    try:
        servers.tcp(slot.netns, "0.0.0.0", 2222)
        slot.apply_policy(policy(WEB_POLICY))
        assert reach(slot.netns, "127.0.0.1", 2222)  # it is listening

        assert not reach(net.internet, addresses.veth_ip(slot.index), 2222)
        ip("-n", net.internet, "route", "add", "192.0.2.0/30", "via", addresses.veth_ip(slot.index))
        assert not reach(net.internet, addresses.GATEWAY_IP, 2222)
        assert lookup(net.internet, "web.test") is None
        assert slot.resolver is not None and slot.resolver.handed_out == {}  # the query never got in
        assert lookup(guest, "web.test") is not None
        assert slot.resolver.handed_out == {net_fakes.ALLOWED_HOST: "web.test"}
    finally:
        servers.close()


def test_an_allowed_name_rebound_to_the_metadata_service_stays_blocked(slot, guest) -> None:
    slot.apply_policy(policy("version: 1\nmode: block\nallow:\n  - host: rebind.test\n    ports: [80]\n"))

    answer = lookup(guest, "rebind.test")

    assert answer is not None and answer.header.rcode == RCODE.REFUSED and answer.rr == []  # not even handed out
    assert not reach(guest, METADATA, 80)


def test_only_the_operators_allowances_open_always_denied_destinations(need_netns, prefix) -> None:
    """The operator's config (never a repository's policy) may open the metadata service or a port of
    the gateway: guard, policy and audit must all agree on that."""
    operator = OperatorAllowances((Rule(frozenset({80}), network=ip_network(f"{METADATA}/32")),
                                   Rule(frozenset({2222}), network=ip_network(f"{addresses.GATEWAY_IP}/32"))))
    with ExitStack() as cleanup:
        internet, servers = net_fakes.build_internet(prefix)
        cleanup.callback(netns.remove, internet)
        cleanup.callback(servers.close)
        cleanup.callback(netns.remove, f"{prefix}-guest")
        pool = SlotPool(prefix, NamespaceUplink(internet), size=1, upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=internet),
                        allowances=operator)
        cleanup.callback(pool.close)
        pool.start()
        slot = pool.acquire(job="operator")
        guest = net_fakes.attach_guest(prefix, slot.netns)
        for port in (2222, 2223):
            servers.tcp(slot.netns, "0.0.0.0", port)
        slot.apply_policy(policy(WEB_POLICY))

        assert reach(guest, METADATA, 80)
        assert reach(guest, addresses.GATEWAY_IP, 2222)
        assert not reach(guest, addresses.GATEWAY_IP, 2223)  # the rest of the gateway stays closed
        assert lookup(guest, "web.test") is not None  # and the repository's policy works as before
        assert reach(guest, ALLOWED_HOST, 8000, name="web.test") and not reach(guest, DENIED_HOST, 8000)
        assert {(r.dest, r.port, r.reason) for r in slot.audit_records()} == {
            (addresses.GATEWAY_IP, 2223, ALWAYS_DENIED), (DENIED_HOST, 8000, POLICY)}
    assert net_fakes.leftovers(prefix) == []
