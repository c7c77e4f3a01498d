"""The production uplink (forwarding + NAT on "the host"), run in a namespace that plays the host.

`HostUplink(namespace=...)` runs exactly the code production runs in the root namespace, but in
`P-host`, which the test built: its "default route" is a veth into the fake internet. The fake
internet has no route back to the slots, so every answer the guest gets proves the masquerade.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from ipaddress import ip_network

import pytest

import tests.net.net_fakes as net_fakes
from policy import OperatorAllowances, Rule, load_policy
from runner.net import HostUplink, SlotPool, Upstream, addresses, netns
from runner.net.leases import PrefixTaken
from tests.net.net_fakes import ALLOWED_HOST, DENIED_HOST, ip, lookup, reach

HOST_WAN = "100.64.0.2"
ISP = "100.64.0.1"
POLICY = "version: 1\nallow:\n  - cidr: 0.0.0.0/0\n    ports: [8000]\n  - host: web.test\n    ports: [9000]\n"


def root_state() -> tuple[str, str]:
    """What the real host's forwarding and firewall look like: must not change."""
    with open("/proc/sys/net/ipv4/ip_forward") as forward:
        flag = forward.read()
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    return flag, "\n".join(line for line in rules.splitlines() if not line.startswith("#"))


@pytest.fixture
def allowances() -> OperatorAllowances:
    return OperatorAllowances()


@pytest.fixture
def host_net(need_netns, prefix: str, allowances: OperatorAllowances) -> Iterator[tuple[str, str, SlotPool]]:
    before = root_state()
    host = f"{prefix}-host"
    with ExitStack() as cleanup:
        internet, servers = net_fakes.build_internet(prefix)
        cleanup.callback(netns.remove, internet)
        cleanup.callback(servers.close)
        netns.create(host)
        cleanup.callback(netns.remove, host)
        cleanup.callback(netns.remove, f"{prefix}-guest")
        ip("-n", host, "link", "add", "wan0", "type", "veth", "peer", "name", "isp0", "netns", internet)
        ip("-n", host, "addr", "add", f"{HOST_WAN}/30", "dev", "wan0")
        ip("-n", host, "link", "set", "wan0", "up")
        ip("-n", host, "link", "set", "lo", "up")
        ip("-n", host, "route", "add", "default", "via", ISP)
        ip("-n", internet, "addr", "add", f"{ISP}/30", "dev", "isp0")
        ip("-n", internet, "link", "set", "isp0", "up")
        servers.tcp(host, HOST_WAN, 8000)  # services of "the host" itself
        servers.tcp(host, HOST_WAN, 3128)
        pool = SlotPool(prefix, HostUplink(namespace=host), size=1, upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=host),
                        allowances=allowances)
        cleanup.callback(pool.close)
        pool.start()
        yield host, internet, pool
    assert net_fakes.leftovers(prefix) == []
    assert root_state() == before


def test_guest_traffic_leaves_through_the_hosts_nat(host_net) -> None:
    host, internet, pool = host_net
    slot = pool.acquire()
    guest = net_fakes.attach_guest(pool.prefix, slot.netns)
    slot.apply_policy(load_policy(POLICY, "host.yml"))

    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
    assert reach(guest, DENIED_HOST, 8000)
    assert lookup(guest, "web.test") is not None
    assert reach(guest, ALLOWED_HOST, 9000, name="web.test")


def test_the_host_itself_is_closed_to_guests(host_net) -> None:
    host, internet, pool = host_net
    slot = pool.acquire()
    guest = net_fakes.attach_guest(pool.prefix, slot.netns)
    slot.apply_policy(load_policy(POLICY, "host.yml"))

    assert reach(internet, HOST_WAN, 8000)  # the host's service is up ...
    assert not reach(guest, HOST_WAN, 8000)  # ... but not for a guest, even under a 0.0.0.0/0 rule


PROXY = OperatorAllowances((Rule(frozenset({3128}), network=ip_network(f"{HOST_WAN}/32")),))


@pytest.mark.parametrize("allowances", [PROXY])
def test_the_operators_allowance_opens_one_port_of_the_host(host_net) -> None:
    host, internet, pool = host_net
    slot = pool.acquire()
    guest = net_fakes.attach_guest(pool.prefix, slot.netns)
    slot.apply_policy(load_policy(POLICY, "host.yml"))

    assert reach(guest, HOST_WAN, 3128)  # e.g. the operator's caching proxy
    assert not reach(guest, HOST_WAN, 8000)  # nothing else of the host


def test_the_outside_cannot_open_connections_to_slots(host_net) -> None:
    host, internet, pool = host_net
    slot = pool.acquire()
    guest = net_fakes.attach_guest(pool.prefix, slot.netns)
    slot.apply_policy(load_policy(POLICY, "host.yml"))
    servers = net_fakes.Servers()
    try:
        servers.tcp(guest, "192.0.2.2", 8000)
        ip("-n", internet, "route", "add", "198.18.0.0/15", "via", HOST_WAN)
        ip("-n", internet, "route", "add", "192.0.2.0/30", "via", HOST_WAN)
        ip("-n", host, "route", "add", "192.0.2.0/30", "via", "198.18.0.2")

        assert not reach(internet, "192.0.2.2", 8000)
    finally:
        servers.close()


def test_close_removes_the_hosts_chains(host_net) -> None:
    host, _, pool = host_net
    tag = f"MVC-{pool.prefix.upper()}"
    rules = subprocess.run(["ip", "netns", "exec", host, "iptables-save"], capture_output=True, text=True, check=True).stdout
    assert f"-A INPUT -j {tag}-IN" in rules and f"-A POSTROUTING -j {tag}-NAT" in rules

    pool.close()

    rules = subprocess.run(["ip", "netns", "exec", host, "iptables-save"], capture_output=True, text=True, check=True).stdout
    assert tag not in rules


def host_rules(host: str) -> str:
    """The host namespace's rules as iptables-save prints them, without its comment lines: those hold the time
    of the save to the second, so two saves of the same rules on either side of a second's tick differ."""
    rules = subprocess.run(["ip", "netns", "exec", host, "iptables-save"], capture_output=True, text=True, check=True).stdout
    return "\n".join(line for line in rules.splitlines() if not line.startswith("#"))


def test_a_second_pool_on_the_same_prefix_leaves_the_hosts_chains_and_slots_alone(host_net) -> None:
    host, _, pool = host_net
    slot = pool.acquire()
    rules = host_rules(host)
    second = SlotPool(pool.prefix, HostUplink(namespace=host), size=1, upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=host))
    with pytest.raises(PrefixTaken, match=r"network\.slot_prefix"):
        second.start()  # it would have swept the first pool's slots and removed its chains
    second.close()  # nor may its close remove them

    assert host_rules(host) == rules and netns.exists(slot.netns)
    guest = net_fakes.attach_guest(pool.prefix, slot.netns)
    slot.apply_policy(load_policy(POLICY, "host.yml"))
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")


def test_pools_of_two_prefixes_on_one_host_route_each_guest_its_own_way(host_net) -> None:
    """Two services beside each other: each slot's uplink /30 is its own, so both guests get answers
    (one address on two veths of the host would route one guest's replies to the other's slot)."""
    host, _, pool = host_net
    ours = pool.acquire()
    other = SlotPool(pool.prefix + "b", HostUplink(namespace=host), size=1, upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=host))
    try:
        other.start()
        theirs = other.acquire()
        guests = [net_fakes.attach_guest(pool.prefix, ours.netns), net_fakes.attach_guest(other.prefix, theirs.netns)]
        for slot in (ours, theirs):
            slot.apply_policy(load_policy(POLICY, "host.yml"))

        assert [reach(guest, ALLOWED_HOST, 8000, name="web.test") for guest in guests] == [True, True]
        assert addresses.uplink_ip(ours.index) != addresses.uplink_ip(theirs.index)
    finally:
        other.close()
        netns.remove(f"{other.prefix}-guest")
