"""A fake internet for the service's real-VM tests, and a probe the guest runs against it.

`fake_internet()` builds tests/net's fake internet (namespaces only: web hosts that answer with their
own address:port, an upstream DNS, a metadata server, a "LAN" host) under a unique prefix. Its
`engine()` settings give a `ServiceHost` that namespace as the slots' uplink and its DNS server as the
resolver's upstream, and `network` is the config section that turns networking on with the same prefix,
so nothing a test's VMs send leaves the namespaces the test created. On exit it checks that no
namespace or link carrying the prefix is left.

`PROBE` is what the guest runs to show which hosts it reaches: each `host:port` argument prints
`open host:port` when the host answered with its banner (so the connection went through to that very
host), `closed host:port` otherwise. Addresses only: the guest never asks the resolver, so a result
depends on the rendered rules alone.
"""

from __future__ import annotations

import secrets
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from runner.net import NamespaceUplink, Upstream, netns
from tests.net import net_fakes
from tests.net.net_fakes import ALLOWED_HOST, DENIED_HOST, LAN_HOST, METADATA  # noqa: F401 (re-exported)

PROBE = textwrap.dedent(
    """
    import socket, sys
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=3) as s:
                s.settimeout(3)
                got = s.recv(100).decode("ascii", "replace")
        except OSError:
            got = ""
        print("open" if got == target else "closed", target, flush=True)
    """
)


def reached(output: str) -> set[str]:
    """The `host:port`s a probe's output says were reached."""
    return {line.split()[1] for line in output.splitlines() if line.startswith("open ")}


def probed(output: str) -> set[str]:
    """Every `host:port` the probe got an answer for, open or closed: proves the probe ran."""
    return {line.split()[1] for line in output.splitlines() if line.split()[:1] in (["open"], ["closed"])}


def cidr_policy(*targets: str, mode: str = "block") -> str:
    """A policy allowing each `host:port` by its /32 (no names: the probe dials addresses)."""
    rules = "".join(f"  - cidr: {t.rsplit(':', 1)[0]}/32\n    ports: [{t.rsplit(':', 1)[1]}]\n" for t in targets)
    return f"version: 1\nmode: {mode}\nallow:\n{rules}" if rules else f"version: 1\nmode: {mode}\nallow: []\n"


@dataclass(frozen=True)
class FakeInternet:
    prefix: str  # of the test's namespaces, and of the service's network slots
    namespace: str  # the fake internet itself

    @property
    def network(self) -> dict[str, Any]:
        """The service config's `network:` section for VMs on this internet."""
        return {"enabled": True, "slot_prefix": self.prefix}

    def engine(self, **settings: Any) -> Any:
        """`EngineSettings` whose slots hang off this internet and whose resolver asks its DNS server."""
        from runner.service.host.assembly import EngineSettings

        return EngineSettings(uplink=NamespaceUplink(self.namespace),
                              upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=self.namespace), **settings)


@contextmanager
def fake_internet() -> Iterator[FakeInternet]:
    """The fake internet, removed on exit; fails if anything carrying its prefix outlives the test."""
    prefix = "s" + secrets.token_hex(3)
    with ExitStack() as cleanup:
        internet, servers = net_fakes.build_internet(prefix)
        cleanup.callback(netns.remove, internet)
        cleanup.callback(servers.close)
        yield FakeInternet(prefix, internet)
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"
