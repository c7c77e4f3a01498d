"""Egress policy on real VMs, inside a fake internet that the test builds from namespaces.

The VM's uplink goes to the test's own "internet" namespace (fake web hosts, a fake package index,
a fake upstream DNS, a fake metadata server); nothing is routed to the machine's real interface.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import http.server
import io
import secrets
import textwrap
import zipfile
from contextlib import ExitStack

import pytest

from policy import load_policy, suggest_policy
from policy.model import DENY_ALL
from runner.net import addresses, netns
from runner.net.audit import REFUSED_ANSWER
from runner.sandbox import Sandbox
from tests.net import net_fakes

INDEX_HOST = "203.0.113.30"
INDEX_PORT = 8080
WHEEL = "demo_pkg-1.0-py3-none-any.whl"

PROBE = textwrap.dedent(
    """
    import ipaddress, socket, sys
    def tcp(host, port, source=None, family=socket.AF_INET):
        try:
            s = socket.socket(family, socket.SOCK_STREAM); s.settimeout(3)
            if source: s.bind((source, 0))
            s.connect((host, port))
        except OSError:
            return "closed"
        try:
            ipaddress.ip_address(host)
        except ValueError:  # a name: say which, as a client under a host: rule must (the host checks it)
            s.sendall(b"GET / HTTP/1.1\\r\\nHost: " + host.encode() + b"\\r\\n\\r\\n")
        try:
            s.settimeout(1); data = s.recv(100)  # the fake web hosts say who they are; HTTP waits
        except OSError:
            data = b""
        s.close()
        return "open:" + data.decode()
    def name(host):
        try:
            return socket.gethostbyname(host)
        except OSError:
            return "nxdomain"
    for line in sys.argv[1:]:
        kind, *args = line.split(",")
        if kind == "tcp":
            print(line, tcp(args[0], int(args[1]), args[2] if len(args) > 2 else None))
        elif kind == "tcp6":
            print(line, tcp(args[0], int(args[1]), family=socket.AF_INET6))
        else:
            print(line, name(args[0]))
    """
)


def make_wheel() -> bytes:
    files = {
        "demo_pkg/__init__.py": b"GREETING = 'installed from the fake index'\n",
        "demo_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
        "demo_pkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "demo_pkg-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr("demo_pkg-1.0.dist-info/RECORD", record)
    return buf.getvalue()


class IndexHandler(http.server.BaseHTTPRequestHandler):
    wheel = make_wheel()
    protocol_version = "HTTP/1.1"  # keeps connections alive, as real indexes do

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/simple/demo-pkg":
            body = f'<html><body><a href="/files/{WHEEL}">{WHEEL}</a></body></html>'.encode()
            kind = "text/html"
        elif self.path == f"/files/{WHEEL}":
            body, kind = self.wheel, "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def serve_index(internet: str, cleanup: ExitStack) -> None:
    net_fakes.http_server_in(internet, INDEX_HOST, INDEX_PORT, IndexHandler, cleanup)


@pytest.fixture
def net_engine(need_netns, make_engine):
    prefix = "v" + secrets.token_hex(3)
    with ExitStack() as cleanup:
        internet, servers = net_fakes.build_internet(prefix)
        cleanup.callback(netns.remove, internet)
        cleanup.callback(servers.close)
        serve_index(internet, cleanup)
        engine = make_engine(net=net_fakes.started_pool(prefix, internet, cleanup))
        cleanup.callback(engine.close)
        yield engine
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def probe(sbx: Sandbox, *checks: str) -> dict[str, str]:
    sbx.files.write("/tmp/probe.py", PROBE.encode())
    r = sbx.exec(["python3", "/tmp/probe.py", *checks], timeout_seconds=120)
    assert r.exit_code == 0, r.stderr
    return dict(line.split(" ", 1) for line in r.stdout.decode().splitlines())


def policy_of(text: str):
    return load_policy(textwrap.dedent(text), "test policy")


def test_only_what_the_policy_allows_is_reachable(net_engine):
    policy = policy_of(
        """
        version: 1
        allow:
          - host: web.test
            ports: [8000]
        """
    )
    uplink = addresses.uplink_ip(0)
    checks = [
        "tcp,web.test,8000",  # allowed by name and port
        "tcp,web.test,9000",  # same host, other port
        f"tcp,{net_fakes.DENIED_HOST},8000",  # another host by address
        f"tcp,{net_fakes.METADATA},80",  # the cloud metadata endpoint
        f"tcp,{addresses.GATEWAY_IP},22",  # the VM's gateway (the host side)
        f"tcp,{uplink},22",  # the host's end of the uplink
        f"tcp,{addresses.veth_ip(0)},53",  # the namespace's own uplink address
        "name,denied.test",
        "name,nowhere.invalid",
    ]
    with Sandbox.create(engine=net_engine, policy=policy) as sbx:
        got = probe(sbx, *checks)
    assert got["tcp,web.test,8000"] == f"open:{net_fakes.ALLOWED_HOST}:8000"
    for check in checks[1:7]:
        assert got[check] == "closed", check
    assert got["name,denied.test"] == "nxdomain"
    assert got["name,nowhere.invalid"] == "nxdomain"


def test_ipv6_and_spoofed_sources_are_dropped(net_engine):
    policy = policy_of(
        f"""
        version: 1
        allow:
          - cidr: {net_fakes.ALLOWED_HOST}/32
            ports: [8000]
        """
    )
    with Sandbox.create(engine=net_engine, policy=policy) as sbx:
        assert probe(sbx, f"tcp,{net_fakes.ALLOWED_HOST},8000")[f"tcp,{net_fakes.ALLOWED_HOST},8000"].startswith("open")
        # root in the guest can configure anything on its side; the host side must not care
        r = sbx.exec(
            "ip -6 addr add 2001:db8:1::2/64 dev eth0 nodad && ip -6 route add default dev eth0 && "
            "ip addr add 198.51.100.7/32 dev eth0"
        )
        assert r.exit_code == 0, r.stderr
        got = probe(sbx, f"tcp6,{net_fakes.SERVER_IP6},8000", f"tcp,{net_fakes.ALLOWED_HOST},8000,198.51.100.7")
        assert got[f"tcp6,{net_fakes.SERVER_IP6},8000"] == "closed"
        assert got[f"tcp,{net_fakes.ALLOWED_HOST},8000,198.51.100.7"] == "closed"
        r = sbx.exec("ip link set eth0 address 52:54:00:00:00:99")
        assert r.exit_code == 0, r.stderr
        spoofed_mac = probe(sbx, f"tcp,{net_fakes.ALLOWED_HOST},8000")
        assert spoofed_mac[f"tcp,{net_fakes.ALLOWED_HOST},8000"] == "closed"


PIP = (
    f"PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --disable-pip-version-check --no-cache-dir "
    f"--retries 0 --timeout 5 --progress-bar off --target /tmp/site "
    f"--trusted-host {INDEX_HOST} --index-url http://{INDEX_HOST}:{INDEX_PORT}/simple demo-pkg"
    " && PYTHONPATH=/tmp/site python3 -c 'import demo_pkg; print(demo_pkg.GREETING)'"
)


def test_pip_install_works_under_a_registry_only_policy_and_fails_under_deny_all(net_engine):
    registry_only = policy_of(
        f"""
        version: 1
        allow:
          - cidr: {INDEX_HOST}/32
            ports: [{INDEX_PORT}]
        """
    )
    with Sandbox.create(engine=net_engine, policy=registry_only) as sbx:
        r = sbx.exec(PIP, timeout_seconds=300)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert b"installed from the fake index" in r.stdout
    with Sandbox.create(engine=net_engine, network=True, policy=DENY_ALL) as sbx:
        r = sbx.exec(PIP, timeout_seconds=300)
        assert r.exit_code != 0
        assert b"installed from the fake index" not in r.stdout


def test_audit_mode_records_attempts_and_its_suggestion_passes_in_block_mode(net_engine):
    job = ["tcp,web.test,8000", f"tcp,{INDEX_HOST},{INDEX_PORT}"]
    audit = policy_of(
        """
        version: 1
        mode: audit
        allow: []
        """
    )
    with Sandbox.create(engine=net_engine, policy=audit) as sbx:
        got = probe(sbx, *job)
        assert all(v.startswith("open") for v in got.values()), got
        records = sbx.blocked_egress()
    destinations = {(r.dest, r.port) for r in records}
    assert (net_fakes.ALLOWED_HOST, 8000) in destinations
    assert (INDEX_HOST, INDEX_PORT) in destinations
    suggested = load_policy(suggest_policy(records), "suggested policy")
    assert suggested.mode == "block"
    with Sandbox.create(engine=net_engine, policy=suggested) as sbx:
        got = probe(sbx, *job, f"tcp,{net_fakes.DENIED_HOST},8000")
    assert got["tcp,web.test,8000"].startswith("open")
    assert got[f"tcp,{INDEX_HOST},{INDEX_PORT}"].startswith("open")
    assert got[f"tcp,{net_fakes.DENIED_HOST},8000"] == "closed"


def test_an_allowed_name_pointing_into_the_lan_is_refused_unless_a_cidr_rule_allows_it(net_engine):
    """The attack from issue 8: the upstream DNS answers an allowed name with a private address."""
    lan = net_fakes.LAN_HOST
    by_name = policy_of(
        """
        version: 1
        allow:
          - host: lan.test
            ports: [8000]
        """
    )
    with Sandbox.create(engine=net_engine, policy=by_name) as sbx:
        got = probe(sbx, "name,lan.test", f"tcp,{lan},8000")
        refused = [r.to_wire() for r in sbx.blocked_egress() if r.reason == REFUSED_ANSWER]
    assert got == {"name,lan.test": "nxdomain", f"tcp,{lan},8000": "closed"}
    # the answer by name only (the guest was not given the address), the attempt by the address it dialled
    assert sorted((r["dest"], r["name"]) for r in refused) == [(lan, None), ("internal address refused", "lan.test")]

    with_cidr = policy_of(
        """
        version: 1
        allow:
          - host: lan.test
            ports: [8000]
          - cidr: 10.0.0.0/24
            ports: [8000]
        """
    )
    with Sandbox.create(engine=net_engine, policy=with_cidr) as sbx:
        got = probe(sbx, "name,lan.test", "tcp,lan.test,8000")
    assert got == {"name,lan.test": lan, "tcp,lan.test,8000": f"open:{lan}:8000"}


# What the guest sends to check the name check from inside a real VM: raw first flights built by
# the guest's own TLS stack and HTTP requests written by hand, each printing what came back.
FIRST_FLIGHTS = textwrap.dedent(
    """
    import socket, ssl, struct, sys
    def hello(sni, ech=False):
        ctx = ssl.create_default_context(); ctx.check_hostname = False
        out = ssl.MemoryBIO(); tls = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname=sni)
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            pass
        record = out.read()
        if not ech:
            return record
        body = record[9:]; at = 34; at += 1 + body[at]; at += 2 + struct.unpack_from("!H", body, at)[0]
        at += 1 + body[at]; (n,) = struct.unpack_from("!H", body, at); extra = struct.pack("!HH", 0xFE0D, 1) + b"\\0"
        body = body[:at] + struct.pack("!H", n + len(extra)) + body[at + 2:] + extra
        hs = b"\\x01" + len(body).to_bytes(3, "big") + body
        return b"\\x16\\x03\\x01" + struct.pack("!H", len(hs)) + hs
    def http(name):
        return ("GET / HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % name).encode()
    def send(address, port, data):
        try:
            s = socket.create_connection((address, port), timeout=5); s.sendall(data); got = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            return "got:" + got.decode("latin-1")
        except OSError as exc:
            return "refused" if isinstance(exc, ConnectionResetError) else "error:" + type(exc).__name__
    web = socket.gethostbyname("web.test")
    pkg = socket.gethostbyname("pkg.test")
    two = b"GET /simple/demo-pkg/ HTTP/1.1\\r\\nHost: pkg.test\\r\\n\\r\\n"
    cases = {
        "http-right": send(web, 8000, http("web.test")),
        "http-other-name": send(web, 8000, http("a.cdn.test")),
        "tls-right": send(web, 8000, hello("web.test")),
        "tls-other-name": send(web, 8000, hello("evil.cdn.test")),
        "tls-no-sni": send(web, 8000, hello(None)),
        "tls-ech": send(web, 8000, hello("web.test", ech=True)),
        "pipelined": send(pkg, 8080, two + two.replace(b"pkg.test", b"evil.test")),
        "kept-alive": send(pkg, 8080, two + two.replace(b"\\r\\n\\r\\n", b"\\r\\nConnection: close\\r\\n\\r\\n")),
    }
    for key, value in cases.items():
        print(key, repr(value))
    """
)


def test_a_host_rule_admits_only_its_own_name_at_the_address_it_resolved_to(net_engine):
    """Issue 18 from a real VM: web.test and a.cdn.test share an address (a CDN), so only the
    TLS SNI / HTTP Host tells them apart; the package index keeps connections alive."""
    policy = policy_of(
        """
        version: 1
        allow:
          - host: web.test
            ports: [8000]
          - host: pkg.test
            ports: [8080]
        """
    )
    with Sandbox.create(engine=net_engine, policy=policy) as sbx:
        sbx.files.write("/tmp/flights.py", FIRST_FLIGHTS.encode())
        r = sbx.exec(["python3", "/tmp/flights.py"], timeout_seconds=180)
        assert r.exit_code == 0, r.stderr
        got = {key: ast.literal_eval(value) for key, value in (line.split(" ", 1) for line in r.stdout.decode().splitlines())}
        records = {(rec.name, rec.reason) for rec in sbx.blocked_egress() if rec.proto == "tcp"}
        pip = sbx.exec(PIP.replace(f"{INDEX_HOST}", "pkg.test"), timeout_seconds=300)
    banner = f"got:{net_fakes.ALLOWED_HOST}:8000"
    assert got["http-right"] == banner and got["tls-right"] == banner
    for refused in ("http-other-name", "tls-other-name", "tls-no-sni", "tls-ech"):
        assert got[refused] == "refused", (refused, got[refused])
    assert got["pipelined"].count("200 OK") == 1, got["pipelined"]  # the evil.test request never left the host
    assert got["kept-alive"].count("200 OK") == 2, got["kept-alive"]  # the same name twice is fine
    assert {("a.cdn.test", "name-refused"), ("evil.cdn.test", "name-refused"), (None, "unnamed"),
            ("web.test", "unnamed"), ("evil.test", "name-refused")} <= records
    assert pip.exit_code == 0, pip.stdout + pip.stderr  # pip through the name check, by name
    assert b"installed from the fake index" in pip.stdout


def test_a_vm_the_engine_hands_back_reaches_nothing_until_its_claim_loads_the_policy(net_engine):
    """Review (issue 33 moved the policy out of the engine): Engine.create takes the request with its policy
    and must not load it; the VM comes back deny-all, and only runner.sandbox.netclaim's claim opens what
    the policy allows. A guest restored from a snapshot runs from the moment it is restored, before the claim."""
    from runner.sandbox.netclaim import claim_network
    from runner.sandbox.port import VMRequest

    policy = policy_of(
        f"""
        version: 1
        allow:
          - cidr: {net_fakes.ALLOWED_HOST}/32
            ports: [8000]
        """
    )
    request = VMRequest(template="base", policy=policy, network_card=True)
    vm = net_engine.create(request)
    try:
        sbx = Sandbox(net_engine, vm)
        before = probe(sbx, f"tcp,{net_fakes.ALLOWED_HOST},8000", f"tcp,{net_fakes.DENIED_HOST},8000", "name,web.test")
        claim_network(vm, request)
        after = probe(sbx, f"tcp,{net_fakes.ALLOWED_HOST},8000", f"tcp,{net_fakes.DENIED_HOST},8000")
    finally:
        net_engine.destroy(vm)
    assert before == {f"tcp,{net_fakes.ALLOWED_HOST},8000": "closed", f"tcp,{net_fakes.DENIED_HOST},8000": "closed",
                      "name,web.test": "nxdomain"}
    assert after == {f"tcp,{net_fakes.ALLOWED_HOST},8000": f"open:{net_fakes.ALLOWED_HOST}:8000",
                     f"tcp,{net_fakes.DENIED_HOST},8000": "closed"}
