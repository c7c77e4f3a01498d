"""Where a slot's traffic goes after it leaves the slot's namespace.

The outer end of each slot's veth pair lives in the uplink's namespace with the slot's .1
address. `HostUplink` is production: the root namespace, forwarding and NAT out of the host's
default route, nothing of the host itself reachable. `NamespaceUplink` is a namespace someone else
built (the tests' fake internet): the slots are simply routed into it. Tests run `HostUplink` only
with `namespace=` set to a namespace of their own: in the root namespace it changes the real
machine's forwarding and NAT.
"""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from policy.render import HostChains, OperatorAllowances, uplink_rules
from runner.errors import NetworkError
from runner.net import addresses, netns

log = logging.getLogger(__name__)

T = TypeVar("T")


class UplinkError(NetworkError):
    """The uplink could not be prepared; nothing can leave the slots."""


class Uplink(ABC):
    """The far side of every slot's veth pair."""

    @property
    @abstractmethod
    def netns(self) -> str | None:
        """Namespace holding the outer veth ends (None: the root namespace)."""

    @abstractmethod
    def prepare(self, prefix: str, allowances: OperatorAllowances = OperatorAllowances()) -> None:
        """Make the namespace ready to carry traffic of slots named `prefix`-N (idempotent); the
        operator's `allowances` may open what the uplink otherwise closes to guests."""

    @abstractmethod
    def close(self, prefix: str) -> None:
        """Undo `prepare`. Only the pool that holds `prefix` (runner.net.leases) calls either: whatever
        is named after the prefix is its own."""

    def run(self, fn: Callable[[], T]) -> T:
        """Call `fn` inside the uplink's namespace."""
        return fn() if self.netns is None else netns.run_in(self.netns, fn)

    def configure_end(self, ifname: str, index: int) -> None:
        """Give the outer end of slot `index` its address and bring it up."""

        def configure() -> None:
            with IPRoute() as ipr:
                link = ipr.link_lookup(ifname=ifname)[0]
                ipr.addr("add", index=link, address=addresses.uplink_ip(index), prefixlen=addresses.UPLINK_PREFIXLEN)
                ipr.link("set", index=link, state="up")

        self.run(configure)

    def link_names(self) -> list[str]:
        def names() -> list[str]:
            with IPRoute() as ipr:
                return [str(link.get("ifname")) for link in ipr.get_links()]

        return self.run(names)

    def delete_link(self, ifname: str) -> None:
        """Delete the outer veth end if it is still there.

        Removing a slot's namespace makes the kernel destroy the veth pair on its own, asynchronously,
        so the link may vanish between the lookup and the delete: ENODEV means done, not failed.
        """

        def delete() -> None:
            with IPRoute() as ipr:
                found = ipr.link_lookup(ifname=ifname)
                if not found:
                    return
                try:
                    ipr.link("del", index=found[0])
                except NetlinkError as exc:
                    if exc.code != errno.ENODEV:
                        raise

        self.run(delete)


@dataclass
class NamespaceUplink(Uplink):
    """Slots routed into an existing namespace (e.g. a test's fake internet); it owns its routing."""

    name: str

    @property
    def netns(self) -> str | None:
        return self.name

    def prepare(self, prefix: str, allowances: OperatorAllowances = OperatorAllowances()) -> None:
        if not netns.exists(self.name):
            raise UplinkError(f"uplink namespace {self.name} does not exist; create it before the slot pool")

    def close(self, prefix: str) -> None:
        """The namespace belongs to whoever made it."""


@dataclass
class HostUplink(Uplink):
    """Production: the host forwards the slots' traffic and masquerades it out of `out_iface`.

    The host itself is closed to the slots (INPUT drop: no host service, address or resolver is
    reachable from a guest through its uplink, except what the operator's allowances open), slots
    may only leave by `out_iface` (never reach each other or another host interface), and nothing
    from outside may open a connection to a slot.
    `out_iface` defaults to the interface of the default route. `namespace` is the namespace playing
    the host: None (the root namespace) in production; the tests pass a namespace they built, so that
    this code runs for real without touching the machine. Enabling forwarding is host-wide: a host
    whose FORWARD policy is ACCEPT would route between its other interfaces too, so that is logged.
    """

    out_iface: str | None = None
    namespace: str | None = None
    iptables: str = "iptables"

    @property
    def netns(self) -> str | None:
        return self.namespace

    def prepare(self, prefix: str, allowances: OperatorAllowances = OperatorAllowances()) -> None:
        self.run(lambda: self._prepare(prefix, allowances))

    def close(self, prefix: str) -> None:
        self.run(lambda: self._remove_chains(prefix))

    def _prepare(self, prefix: str, allowances: OperatorAllowances) -> None:
        out = self.out_iface or _default_route_iface()
        self._remove_chains(prefix)  # a dead predecessor's: the pool holds the prefix host-wide (runner.net.leases)
        with open("/proc/sys/net/ipv4/ip_forward", "w") as forward:
            forward.write("1\n")
        if "-P FORWARD ACCEPT" in self._ipt("-S", "FORWARD"):
            log.warning("the host's FORWARD policy is ACCEPT: with forwarding on it routes between its interfaces")
        for table, hook, chain in _hooks(prefix):
            self._ipt("-t", table, "-N", chain)
            self._ipt("-t", table, "-I", hook, "-j", chain)
        (_, _, into_host), (_, _, through), (_, _, nat) = _hooks(prefix)
        chains = HostChains(into_host=into_host, through=through, nat=nat)
        for table, line in uplink_rules(chains, f"{prefix}-+", out, addresses.UPLINK_POOL, allowances):
            self._ipt("-t", table, *line.split())

    def _remove_chains(self, prefix: str) -> None:
        for table, hook, chain in _hooks(prefix):
            self._ipt("-t", table, "-D", hook, "-j", chain, check=False)
            self._ipt("-t", table, "-F", chain, check=False)
            self._ipt("-t", table, "-X", chain, check=False)

    def _ipt(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([self.iptables, "-w", *args], capture_output=True, text=True)
        if check and done.returncode != 0:
            raise UplinkError(f"{self.iptables} {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout


def _hooks(prefix: str) -> tuple[tuple[str, str, str], ...]:
    """(table, hook, chain) of the pool `prefix`'s host chains: into the host, through it, its NAT."""
    tag = f"MVC-{prefix.upper()}"
    return (("filter", "INPUT", f"{tag}-IN"), ("filter", "FORWARD", f"{tag}-FWD"), ("nat", "POSTROUTING", f"{tag}-NAT"))


def _default_route_iface() -> str:
    with IPRoute() as ipr:
        for route in ipr.get_default_routes(family=socket.AF_INET):
            oif = route.get("RTA_OIF")
            if oif:
                return str(ipr.get_links(oif)[0].get("ifname"))
    raise UplinkError("the host has no IPv4 default route; give HostUplink an explicit out_iface")
