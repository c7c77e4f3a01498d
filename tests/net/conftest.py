"""Fixtures for the network tests: a fake internet, a slot pool attached to it, a stand-in guest.

Every fixture cleans up after itself, and the `net` fixture asserts that nothing carrying the
test's unique prefix (namespace, veth, thread) is left behind.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import pytest

import tests.net.net_fakes as net_fakes
from runner.net import NamespaceUplink, Slot, SlotPool, Upstream, netns


@dataclass
class Net:
    prefix: str
    internet: str
    pool: SlotPool
    clock: net_fakes.Clock  # times the resolver's openings: advance it to expire them
    servers: net_fakes.Servers | None = None  # the fake internet's servers (stopped at the end)


@pytest.fixture
def prefix() -> str:
    return "t" + secrets.token_hex(3)


@pytest.fixture
def net(need_netns, prefix: str) -> Iterator[Net]:
    threads_before = set(threading.enumerate())
    with ExitStack() as cleanup:  # every step runs even when an earlier one fails
        internet, servers = net_fakes.build_internet(prefix)
        cleanup.callback(netns.remove, internet)
        cleanup.callback(netns.remove, f"{prefix}-guest")
        cleanup.callback(servers.close)
        clock = net_fakes.Clock()
        pool = SlotPool(prefix, NamespaceUplink(internet), size=1, upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=internet),
                        clock=clock)
        cleanup.callback(pool.close)
        pool.start()
        yield Net(prefix, internet, pool, clock, servers)
    assert net_fakes.leftovers(prefix) == []
    ours = ("mvc-", "netns:", net_fakes.SERVER_THREAD)  # pyroute2's own helpers come and go
    stray = [t for t in set(threading.enumerate()) - threads_before if t.is_alive() and t.name.startswith(ours)]
    assert stray == [], f"threads left running: {stray}"


@pytest.fixture
def slot(net: Net) -> Slot:
    return net.pool.acquire(job="test-job")


@pytest.fixture
def guest(net: Net, slot: Slot) -> str:
    return net_fakes.attach_guest(net.prefix, slot.netns)
