"""A job's guest cannot reach the attach path (issue 37), on a real VM through the production uplink.

The terminal endpoint (GET /v1/jobs/<id>/terminal) is served on the service's Unix socket and on its TCP
listener (`listen`). The socket is a file of the host's: nothing of it is in the guest. The TCP listener is
an address of the host's, and the host is closed to its guests whatever their policy says: the slot's
guard drops what is addressed to the namespace itself, and the uplink drops everything the slots send to
the host (`HostUplink`: INPUT). Here the production uplink runs in a namespace that plays the host
(as tests/net/test_net_host_uplink.py does), the service is built inside it so its TCP listener is bound
to the host's own address there, and a job whose policy opens that very address and port (a `cidr:` rule
that opts into the range) dials it, the slot's gateway and the uplink's addresses: nothing answers, while
the fake internet, on the same policy, does, and the listener answers from outside.
Needs root, QEMU, network namespaces and the built `base` template: failing under CI=true.
"""

from __future__ import annotations

import http.client
import secrets
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from runner.jobapi.client import JobClient
from runner.net import HostUplink, Upstream, addresses, netns
from runner.service.config.reading import config_from_mapping
from tests.e2e.vm_jobs import output, submit, templates, vm_root  # noqa: F401 (fixtures)
from tests.net import net_fakes
from tests.net.net_fakes import ALLOWED_HOST, ip

pytestmark = pytest.mark.vm

HOST_WAN = "100.64.0.2"  # the host's own address (CGNAT: a `cidr:` rule inside it opts into it)
ISP = "100.64.0.1"
TOKEN = "a-test-token-of-32-characters-xx"
# Dials each host:port, says what happened: "connected" is a failure of the walls for the host's addresses.
DIAL = textwrap.dedent(
    """
    import socket, sys
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=3):
                print("connected", target, flush=True)
        except OSError as exc:
            print("failed", target, type(exc).__name__, flush=True)
    """
)


@pytest.fixture
def host_side(need_netns: None, vm_root: Path) -> Iterator[tuple[Any, str]]:
    """A started `ServiceHost` built inside a namespace playing the host (its TCP listener on HOST_WAN),
    its slots behind the production uplink there; and the fake internet's namespace."""
    from runner.service.host.assembly import EngineSettings, ServiceHost

    prefix = "s" + secrets.token_hex(3)
    host_ns = f"{prefix}-host"
    with ExitStack() as stack:
        internet, servers = net_fakes.build_internet(prefix)
        stack.callback(netns.remove, internet)
        stack.callback(servers.close)
        netns.create(host_ns)
        stack.callback(netns.remove, host_ns)
        ip("-n", host_ns, "link", "add", "wan0", "type", "veth", "peer", "name", "isp0", "netns", internet)
        ip("-n", host_ns, "addr", "add", f"{HOST_WAN}/30", "dev", "wan0")
        ip("-n", host_ns, "link", "set", "wan0", "up")
        ip("-n", host_ns, "link", "set", "lo", "up")
        ip("-n", host_ns, "route", "add", "default", "via", ISP)
        ip("-n", internet, "addr", "add", f"{ISP}/30", "dev", "isp0")
        ip("-n", internet, "link", "set", "isp0", "up")
        store = vm_root / "policies"
        config = config_from_mapping({
            "socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"), "shutdown_grace_seconds": 0,
            "listen": f"{HOST_WAN}:0", "token": TOKEN, "policy_dir": str(store),
            "network": {"enabled": True, "slot_prefix": prefix}})
        engine = EngineSettings(uplink=HostUplink(namespace=host_ns), pool_size=0,
                                upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=host_ns))
        # built in the namespace: every socket it binds (the TCP listener) and thread it starts live there
        host = netns.run_in(host_ns, lambda: stack.enter_context(ServiceHost(config, engine=engine)))
        stack.callback(_no_vm_outlives, host)
        yield host, internet
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def _no_vm_outlives(host: Any) -> None:
    host.service.drain()
    assert host.engine.live() == [], "a job's VM outlived the service"


def _health_from(namespace: str, port: int) -> int:
    """The listener's answer to a client of the fake internet (so it is up, and reachable from outside)."""
    def ask() -> int:
        conn = http.client.HTTPConnection(HOST_WAN, port, timeout=10)
        try:
            conn.request("GET", "/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
            return conn.getresponse().status
        finally:
            conn.close()
    return netns.run_in(namespace, ask)


def test_the_guest_reaches_neither_the_socket_nor_the_tcp_listener_even_under_a_policy_naming_them(
        host_side: tuple[Any, str], vm_root: Path) -> None:
    host, internet = host_side
    port = host.api.tcp_address[1]
    assert _health_from(internet, port) == 200  # the listener is up on the host's address
    (vm_root / "policies" / "octo").mkdir(parents=True)
    (vm_root / "policies" / "octo" / "hello.yml").write_text(
        "version: 1\nallow:\n"
        f"  - cidr: {HOST_WAN}/32\n    ports: [{port}]\n"  # names the host's address: opts into its range
        f"  - cidr: 0.0.0.0/0\n    ports: [8000, {port}]\n")
    host_side_addresses = [HOST_WAN, addresses.GATEWAY_IP, addresses.uplink_ip(0), addresses.veth_ip(0)]
    targets = [f"{a}:{port}" for a in host_side_addresses] + [f"{ALLOWED_HOST}:8000"]
    sock = host.config.socket
    client = JobClient(socket=sock)
    job = submit(client, f"for f in {sock} {Path(sock).parent}; do test -e $f && echo present $f; done; "
                         f"python3 dial.py {' '.join(targets)}",
                 files={"dial.py": DIAL.encode()}, timeout_seconds=300)
    text = output(client, job).decode()
    record = client.get(job)
    assert record.state == "finished", (record, text)
    dialled = {line.split()[1]: line.split()[0] for line in text.splitlines() if line.split()[:1] in
               (["connected"], ["failed"])}
    assert dialled.get(f"{ALLOWED_HOST}:8000") == "connected", text  # the guest's network works under this policy
    for address in host_side_addresses:
        assert dialled.get(f"{address}:{port}") == "failed", f"the guest reached {address}:{port}: {text}"
    assert "present" not in text, text  # neither the socket nor its directory is in the guest
