"""Where a slot's traffic goes after it leaves the slot's namespace.

The outer end of each slot's veth pair lives in the uplink's namespace with the slot's .1
address. `HostUplink` is production: the root namespace, forwarding and NAT out of the host's
default route, nothing of the host itself reachable. `NamespaceUplink` is a namespace someone else
built (the tests' fake internet): the slots are simply routed into it. Tests must never use
`HostUplink`: it touches the real machine's forwarding and NAT.
"""

from __future__ import annotations

import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass

from pyroute2 import IPRoute

from runner.net import addresses, netns


class UplinkError(RuntimeError):
    """The uplink could not be prepared; nothing can leave the slots."""


class Uplink(ABC):
    """The far side of every slot's veth pair."""

    @property
    @abstractmethod
    def netns(self) -> str | None:
        """Namespace holding the outer veth ends (None: the root namespace)."""

    @abstractmethod
    def prepare(self, prefix: str) -> None:
        """Make the namespace ready to carry traffic of slots named `prefix`-N (idempotent)."""

    @abstractmethod
    def close(self, prefix: str) -> None:
        """Undo `prepare`."""

    def run(self, fn):  # type: ignore[no-untyped-def]
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
        def delete() -> None:
            with IPRoute() as ipr:
                found = ipr.link_lookup(ifname=ifname)
                if found:
                    ipr.link("del", index=found[0])

        self.run(delete)


@dataclass
class NamespaceUplink(Uplink):
    """Slots routed into an existing namespace (e.g. a test's fake internet); it owns its routing."""

    name: str

    @property
    def netns(self) -> str | None:
        return self.name

    def prepare(self, prefix: str) -> None:
        if not netns.exists(self.name):
            raise UplinkError(f"uplink namespace {self.name} does not exist; create it before the slot pool")

    def close(self, prefix: str) -> None:
        """The namespace belongs to whoever made it."""


@dataclass
class HostUplink(Uplink):
    """Production: the root namespace forwards the slots' traffic and masquerades it out of `out_iface`.

    The host itself is closed to the slots (INPUT drop), and slots reach only `out_iface`, never each
    other or another host interface. Needs root and changes the host's firewall: never run in tests.
    """

    out_iface: str
    iptables: str = "iptables"

    _CHAINS = (("filter", "INPUT", "MVC-UPLINK-IN"), ("filter", "FORWARD", "MVC-UPLINK-FWD"), ("nat", "POSTROUTING", "MVC-UPLINK-NAT"))

    @property
    def netns(self) -> str | None:
        return None

    def prepare(self, prefix: str) -> None:
        with open("/proc/sys/net/ipv4/ip_forward", "w") as forward:
            forward.write("1\n")
        self.close(prefix)
        pool, slots = str(addresses.UPLINK_POOL), f"{prefix}-+"
        for table, hook, chain in self._CHAINS:
            self._ipt("-t", table, "-N", chain)
            self._ipt("-t", table, "-I", hook, "-j", chain)
        self._ipt("-A", "MVC-UPLINK-IN", "-i", slots, "-j", "DROP")
        self._ipt("-A", "MVC-UPLINK-FWD", "-i", slots, "-o", self.out_iface, "-s", pool, "-j", "ACCEPT")
        self._ipt("-A", "MVC-UPLINK-FWD", "-i", slots, "-j", "DROP")
        self._ipt("-A", "MVC-UPLINK-FWD", "-o", slots, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        self._ipt("-A", "MVC-UPLINK-FWD", "-o", slots, "-j", "DROP")
        self._ipt("-t", "nat", "-A", "MVC-UPLINK-NAT", "-s", pool, "-o", self.out_iface, "-j", "MASQUERADE")

    def close(self, prefix: str) -> None:
        for table, hook, chain in self._CHAINS:
            self._ipt("-t", table, "-D", hook, "-j", chain, check=False)
            self._ipt("-t", table, "-F", chain, check=False)
            self._ipt("-t", table, "-X", chain, check=False)

    def _ipt(self, *args: str, check: bool = True) -> None:
        done = subprocess.run([self.iptables, "-w", *args], capture_output=True, text=True)
        if check and done.returncode != 0:
            raise UplinkError(f"{self.iptables} {' '.join(args)} failed: {done.stderr.strip()}")
