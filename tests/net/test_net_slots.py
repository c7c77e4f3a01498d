"""The slot pool: creation, clean release, start-up sweep, limits, and the tap QEMU attaches to."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import ExitStack

import pytest
from pyroute2 import IPRoute, NFCTSocket

import tests.net.net_fakes as net_fakes
from policy import load_policy
from runner.net import Firewall, FirewallError, NamespaceUplink, SlotError, SlotPool, Upstream, addresses, leases, netns
from runner.net.leases import PrefixTaken
from tests.net.net_fakes import ALLOWED_HOST, ip, lookup, reach

CIDR_POLICY = "version: 1\nmode: block\nallow:\n  - cidr: 203.0.113.0/24\n    ports: [8000]\n  - host: web.test\n    ports: [9000]\n"


def links(ns: str) -> dict[str, list[str]]:
    def read() -> dict[str, list[str]]:
        with IPRoute() as ipr:
            return {
                str(link.get("ifname")): [
                    f"{a.get('IFA_ADDRESS')}/{a['prefixlen']}" for a in ipr.get_addr(index=link["index"], family=2)
                ]
                for link in ipr.get_links()
            }

    return netns.run_in(ns, read)


def conntrack_entries(ns: str) -> int:
    def count() -> int:
        with NFCTSocket() as ct:
            return len(list(ct.dump()))

    return netns.run_in(ns, count)


def test_slot_layout(net, slot) -> None:
    inside = links(slot.netns)
    outside = links(net.internet)

    assert inside[addresses.TAP_NAME] == [f"{addresses.GATEWAY_IP}/30"]
    assert inside[addresses.VETH_NAME] == [f"{addresses.veth_ip(slot.index)}/30"]
    assert outside[slot.netns] == [f"{addresses.uplink_ip(slot.index)}/30"]
    shown = subprocess.run(["ip", "-n", slot.netns, "-d", "link", "show", addresses.TAP_NAME], capture_output=True, text=True, check=True)
    assert "tun type tap" in shown.stdout and "persist on" in shown.stdout


def test_uplink_addresses_follow_the_slot_index() -> None:
    assert (addresses.uplink_ip(0), addresses.veth_ip(0)) == ("198.18.0.1", "198.18.0.2")
    assert str(addresses.slot_network(16383)) == "198.18.255.252/30"
    assert addresses.MAX_SLOTS >= 16384
    assert addresses.veth_ip(addresses.MAX_SLOTS - 1) == "198.19.255.254"
    with pytest.raises(ValueError, match=r"^slot index 32768 is outside 0\.\.32767$"):
        addresses.slot_network(addresses.MAX_SLOTS)


def test_release_leaves_nothing_of_the_job(net, slot, guest) -> None:
    slot.apply_policy(load_policy(CIDR_POLICY, "p.yml"))
    assert lookup(guest, "web.test") is not None
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
    assert conntrack_entries(slot.netns) > 0
    assert slot.resolver is not None and slot.resolver.handed_out

    net.pool.release(slot)

    assert conntrack_entries(slot.netns) == 0
    assert slot.resolver.handed_out == {} and slot.resolver.openings == {}
    assert slot.audit_records() == []
    assert not reach(guest, ALLOWED_HOST, 8000, name="web.test")  # deny-all again
    assert lookup(guest, "web.test") is None
    assert net.pool.acquire().netns == slot.netns


def test_acquire_beyond_the_pool_creates_slots_until_the_limit(need_netns, prefix) -> None:
    internet = f"{prefix}-inet"
    netns.create(internet)
    pool = SlotPool(prefix, NamespaceUplink(internet), size=1, upstream=Upstream("192.0.2.53"), max_slots=2)
    try:
        pool.start()
        first, second = pool.acquire(), pool.acquire()
        assert {first.netns, second.netns} == {f"{prefix}-0", f"{prefix}-1"}
        with pytest.raises(SlotError, match="in use"):
            pool.acquire()
        pool.release(first)
        assert pool.acquire().netns == first.netns
    finally:
        pool.close()
        netns.remove(internet)
    assert [n for n in netns.names() if n.startswith(prefix)] == []


def test_sweep_removes_only_what_no_live_slot_owns(net, slot) -> None:
    stale_ns = f"{net.prefix}-7"
    stale_veth = f"{net.prefix}-8"
    netns.create(stale_ns)
    ip("-n", net.internet, "link", "add", stale_veth, "type", "veth", "peer", "name", "x" + net.prefix)
    try:
        removed = net.pool.sweep()
    finally:
        netns.remove(stale_ns)

    assert sorted(removed) == sorted([stale_ns, stale_veth])
    assert netns.exists(slot.netns)
    assert slot.netns in links(net.internet)


def test_a_policy_document_that_touches_slot_tables_is_refused(slot) -> None:
    from runner.net.firewall import check_policy_document

    with pytest.raises(FirewallError, match="nat"):
        check_policy_document("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n", "IPv4")
    with pytest.raises(FirewallError, match="rejected"):
        slot.firewall.load(slot.netns, "*filter\n-A FORWARD -j NO-SUCH-CHAIN\nCOMMIT\n")


def test_releasing_a_slot_twice_leaves_its_next_holder_alone(net, slot, guest) -> None:
    net.pool.release(slot)
    holder = net.pool.acquire()
    holder.apply_policy(load_policy(CIDR_POLICY, "p.yml"))

    net.pool.release(slot)  # a stale second release from the previous VM

    assert holder.netns == slot.netns and reach(guest, ALLOWED_HOST, 8000, name="web.test")


def test_discarding_a_stale_handle_leaves_the_next_holder_alone(net, slot, guest) -> None:
    net.pool.release(slot)
    holder = net.pool.acquire()
    holder.apply_policy(load_policy(CIDR_POLICY, "p.yml"))

    net.pool.discard(slot)  # the previous VM's handle, discarded after its release

    assert holder.netns == slot.netns and holder.netns in netns.names()
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
    net.pool.discard(holder)
    assert holder.netns not in netns.names()


def test_the_nf_tables_backend_enforces_the_same_policy(need_netns, prefix) -> None:
    """Hosts without legacy iptables get nf_tables (`Firewall.default()`); it must mean the same."""
    with ExitStack() as cleanup:
        internet, servers = net_fakes.build_internet(prefix)
        cleanup.callback(netns.remove, internet)
        cleanup.callback(netns.remove, f"{prefix}-guest")
        cleanup.callback(servers.close)
        pool = SlotPool(prefix, NamespaceUplink(internet), size=1, firewall_tools=Firewall.nft(),
                        upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=internet))
        cleanup.callback(pool.close)
        pool.start()
        slot = pool.acquire()
        guest = net_fakes.attach_guest(prefix, slot.netns)
        slot.apply_policy(load_policy(CIDR_POLICY, "p.yml"))

        assert reach(guest, ALLOWED_HOST, 8000, name="web.test")
        assert not reach(guest, ALLOWED_HOST, 9000, name="web.test")
        assert lookup(guest, "web.test") is not None
        assert reach(guest, ALLOWED_HOST, 9000, name="web.test")
        assert not reach(slot.netns, ALLOWED_HOST, 8000)
    assert net_fakes.leftovers(prefix) == []


def test_a_veth_the_kernel_removes_mid_delete_counts_as_deleted(need_netns, prefix, monkeypatch) -> None:
    """Removing a namespace makes the kernel drop its veth pair asynchronously, racing our own delete."""
    ns = f"{prefix}-up"
    netns.create(ns)
    try:
        uplink = NamespaceUplink(ns)
        ip("-n", ns, "link", "add", f"{prefix}-a", "type", "veth", "peer", "name", f"{prefix}-b")

        class RacingIPRoute(IPRoute):
            def link_lookup(self, **spec):  # type: ignore[no-untyped-def]
                found = IPRoute.__getattr__(self, "link_lookup")(**spec)  # pyroute2 delegates by name
                self.link("del", index=found[0])  # the kernel's cleanup wins the race
                return found

        monkeypatch.setattr("runner.net.uplink.IPRoute", RacingIPRoute)
        uplink.delete_link(f"{prefix}-a")
        monkeypatch.undo()
        assert f"{prefix}-a" not in uplink.link_names()
    finally:
        netns.remove(ns)


def test_a_second_pool_on_the_same_prefix_is_refused_and_the_first_keeps_its_slots(net, slot, guest) -> None:
    second = SlotPool(net.prefix, NamespaceUplink(net.internet), size=1,
                      upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=net.internet))
    with pytest.raises(PrefixTaken, match=rf"in use on this host by pid {os.getpid()} .*network\.slot_prefix"):
        second.start()  # its start-up sweep would have removed the first pool's namespaces and veths
    second.close()

    assert netns.exists(slot.netns) and slot.netns in links(net.internet)
    slot.apply_policy(load_policy(CIDR_POLICY, "p.yml"))
    assert reach(guest, ALLOWED_HOST, 8000, name="web.test")


def test_pools_of_two_prefixes_on_one_uplink_namespace_take_distinct_addresses(net, slot) -> None:
    other = SlotPool(net.prefix + "b", NamespaceUplink(net.internet), size=1,
                     upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=net.internet))
    try:
        other.start()
        theirs = other.acquire()
        outside = links(net.internet)
        assert theirs.index != slot.index
        assert outside[slot.netns] == [f"{addresses.uplink_ip(slot.index)}/30"]
        assert outside[theirs.netns] == [f"{addresses.uplink_ip(theirs.index)}/30"]
    finally:
        other.close()


def test_slot_indices_are_leased_per_uplink_namespace(tmp_path) -> None:
    held = leases.lease_index("a-inet", 0, tmp_path)
    assert held is not None
    assert leases.lease_index("a-inet", 0, tmp_path) is None  # another pool on that uplink: the next index
    beside = leases.lease_index("b-inet", 0, tmp_path)  # another namespace: the same /30 is no clash there
    root = leases.lease_index(None, 0, tmp_path)
    assert beside is not None and root is not None

    for lease in (held, beside, root):
        lease.release()
    assert list(tmp_path.iterdir()) == []  # a released lease leaves no file
    again = leases.lease_index("a-inet", 0, tmp_path)
    assert again is not None
    again.release()


def test_a_refused_prefix_names_its_holder_and_the_setting_to_change(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from runner.net import leases; leases.claim_prefix('job', Path(sys.argv[1])); "
                               "print('held', flush=True); sys.stdin.read()", str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(PrefixTaken) as refused:
            leases.claim_prefix("job", tmp_path)
        assert f"by pid {holder.pid} (" in str(refused.value) and "network.slot_prefix" in str(refused.value)
    finally:
        holder.communicate("")  # its stdin closes: it exits, and the kernel drops its lock
    leases.claim_prefix("job", tmp_path).release()
