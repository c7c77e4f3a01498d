"""A fake internet built from namespaces, and a stand-in guest, for the slot tests.

Topology (every name carries the test's unique prefix P):

    P-guest: eth0 52:54:00:00:00:02 192.0.2.2/30 --veth-- tap0 192.0.2.1/30 in the slot P-N
    P-N: veth0 198.18.x.2 --veth-- P-N 198.18.x.1 in P-inet
    P-inet: the fake hosts' addresses on its loopback (allowed web, denied web, upstream DNS, metadata,
            and a "LAN" host at a private address, standing for what lies behind a runner host)

The stand-in guest is a namespace whose veth end replaces the slot's tap0 under the same name:
the slot's rules match on the interface name, so the kernel treats it exactly like the tap QEMU
would attach to, while the guest side gets a real TCP/IP stack for the tests to drive. That the real
tap is attachable by its owner is tested separately (test_tap.py).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dnslib import CNAME, QTYPE, RCODE, RR, A, DNSRecord

from runner.net import addresses, netns

ALLOWED_HOST = "203.0.113.10"
DENIED_HOST = "203.0.113.20"
UPSTREAM_DNS = "203.0.113.53"
METADATA = "169.254.169.254"
LAN_HOST = "10.0.0.5"  # private (RFC 1918): what an allowed name must not lead to without a cidr: rule
SERVER_IP6 = "2001:db8:3::10"
ZONE: dict[str, str | list[str]] = {
    "web.test": ALLOWED_HOST,
    "denied.test": DENIED_HOST,
    "a.cdn.test": ALLOWED_HOST,
    "edge.cdn.example": ALLOWED_HOST,
    "rebind.test": METADATA,  # DNS rebinding: an allowed name pointing at the metadata service
    "lan.test": LAN_HOST,  # ... or at the LAN behind the runner host
    "mixed.test": [ALLOWED_HOST, LAN_HOST],
    "wiki.corp.example": LAN_HOST,  # a name only the host's (split-horizon) resolver knows
    "pkg.test": "203.0.113.30",  # tests/vm/test_vm_network.py's package index, when a test serves it
}
TTL = 60
SERVER_THREAD = "fake-server"
ALIASES = {"files.web.test": "edge.cdn.example",  # a CDN-style CNAME
           "intranet.web.test": "wiki.corp.example"}  # a fork's allowed name pointed at an internal one


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def in_ns(name: str, fn):  # type: ignore[no-untyped-def]
    return netns.run_in(name, fn)


class Clock:
    """time.monotonic() plus an offset a test moves forward: expiries without waiting for them."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


class FrozenClock(Clock):
    """A clock that moves only when a test advances it: counts that depend on time are exact."""

    def __call__(self) -> float:
        return 1000.0 + self.offset


@dataclass
class Servers:
    """TCP banner servers and a DNS server, all in the fake internet, stopped on close."""

    sockets: list[socket.socket] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    queries: int = 0

    def tcp(self, ns: str, address: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = netns.socket_in(ns, family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(16)
        sock.settimeout(0.2)
        self._spawn(lambda: self._serve_tcp(sock, port), sock)

    def dns(self, ns: str | None, address: str, port: int = 53) -> int:
        """A DNS server answering from `ZONE`; returns its port (pass 0 for any free one)."""
        sock = netns.socket_in(ns, socket.AF_INET, socket.SOCK_DGRAM) if ns else socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((address, port))
        sock.settimeout(0.2)
        self._spawn(lambda: self._serve_dns(sock), sock)
        return int(sock.getsockname()[1])

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        for sock in self.sockets:
            sock.close()

    def _spawn(self, target, sock: socket.socket) -> None:  # type: ignore[no-untyped-def]
        self.sockets.append(sock)
        thread = threading.Thread(target=target, name=SERVER_THREAD, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _serve_tcp(self, sock: socket.socket, port: int) -> None:
        """Answer each connection with the address:port it reached, so a test knows who answered."""
        while not self.stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.sendall(f"{conn.getsockname()[0]}:{port}".encode())

    def _serve_dns(self, sock: socket.socket) -> None:
        while not self.stop.is_set():
            try:
                data, peer = sock.recvfrom(4096)
            except (TimeoutError, OSError):
                continue
            self.queries += 1
            query = DNSRecord.parse(data)
            name = str(query.q.qname).rstrip(".")
            reply = query.reply()
            if name in ALIASES:
                reply.add_answer(RR(query.q.qname, QTYPE.CNAME, rdata=CNAME(ALIASES[name]), ttl=TTL))
                reply.add_answer(RR(ALIASES[name], QTYPE.A, rdata=A(ZONE[ALIASES[name]]), ttl=TTL))
                reply.add_answer(RR("unrelated.example", QTYPE.A, rdata=A(DENIED_HOST), ttl=TTL))
            elif name in ZONE and query.q.qtype == QTYPE.A:
                found = ZONE[name]
                for address in [found] if isinstance(found, str) else found:
                    reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(address), ttl=TTL))
            elif name not in ZONE:
                reply.header.rcode = RCODE.NXDOMAIN
            sock.sendto(reply.pack(), peer)


def build_internet(prefix: str) -> tuple[str, Servers]:
    """The fake internet namespace with its hosts; the slot pool attaches to it as uplink."""
    name = f"{prefix}-inet"
    netns.create(name)
    servers = Servers()
    try:
        ip("-n", name, "link", "set", "lo", "up")
        for address in (ALLOWED_HOST, DENIED_HOST, UPSTREAM_DNS, METADATA, LAN_HOST):
            ip("-n", name, "addr", "add", f"{address}/32", "dev", "lo")
        ip("-n", name, "-6", "addr", "add", f"{SERVER_IP6}/128", "dev", "lo", "nodad")
        for host, port in ((ALLOWED_HOST, 8000), (ALLOWED_HOST, 9000), (DENIED_HOST, 8000), (METADATA, 80),
                           (LAN_HOST, 8000)):
            servers.tcp(name, host, port)
        servers.tcp(name, SERVER_IP6, 8000)
        servers.dns(name, UPSTREAM_DNS)
    except BaseException:
        servers.close()
        netns.remove(name)
        raise
    return name, servers


def attach_guest(prefix: str, slot_ns: str) -> str:
    """Replace the slot's tap0 by a veth whose other end is the stand-in guest's eth0."""
    guest = f"{prefix}-guest"
    netns.create(guest)
    ip("-n", slot_ns, "link", "del", addresses.TAP_NAME)
    ip("-n", slot_ns, "link", "add", addresses.TAP_NAME, "type", "veth", "peer", "name", "eth0", "netns", guest)
    ip("-n", slot_ns, "addr", "add", f"{addresses.GATEWAY_IP}/{addresses.GUEST_PREFIXLEN}", "dev", addresses.TAP_NAME)
    ip("-n", slot_ns, "link", "set", addresses.TAP_NAME, "up")
    ip("-n", guest, "link", "set", "lo", "up")
    ip("-n", guest, "link", "set", "eth0", "address", addresses.GUEST_MAC)
    ip("-n", guest, "addr", "add", f"{addresses.GUEST_IP}/{addresses.GUEST_PREFIXLEN}", "dev", "eth0")
    ip("-n", guest, "link", "set", "eth0", "up")
    ip("-n", guest, "route", "add", "default", "via", addresses.GATEWAY_IP)
    return guest


def reach(guest: str, address: str, port: int, source: str | None = None, timeout: float = 1.5,
          name: str | None = None) -> bool:
    """Whether the guest gets the server's banner from address:port (refused or silent: False).

    With `name`, the guest first sends an HTTP request with `Host: name`, as a client under a
    `host:` rule must (the host's name check admits nothing that does not say which name it is
    for); the banner servers answer every connection alike, so it changes nothing where no name
    check sits in between."""

    def connect() -> bool:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            if source:
                sock.bind((source, 0))
            try:
                sock.connect((address, port))
                if name is not None:
                    sock.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
                return sock.recv(100) == f"{address}:{port}".encode()
            except OSError:
                return False

    return in_ns(guest, connect)


def lookup(guest: str, name: str, qtype: str = "A", tcp: bool = False) -> DNSRecord | None:
    """The guest's resolver's answer, or None when it gave none."""

    def ask() -> DNSRecord | None:
        try:
            reply = DNSRecord.question(name, qtype).send(addresses.DNS_IP, addresses.DNS_PORT, tcp=tcp, timeout=2)
        except OSError:
            return None
        return DNSRecord.parse(reply)

    return in_ns(guest, ask)


def leftovers(prefix: str) -> list[str]:
    """Namespaces and root-namespace links that carry the test's prefix."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    found = [n for n in netns.names() if n.startswith(prefix)]
    found += [line.split(": ")[1].split("@")[0] for line in links.splitlines() if line.split(": ")[1].startswith(prefix)]
    return found


def serve_in_internet(net, address: str, port: int, handle: Callable[[socket.socket], None]) -> None:  # type: ignore[no-untyped-def]
    """A TCP server at address:port in the fake internet that runs `handle(conn)` for each connection,
    one at a time, until the test's servers stop (the connection is closed after)."""
    sock = netns.socket_in(net.internet, socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(16)
    sock.settimeout(0.2)
    servers = net.servers

    def serve() -> None:
        while not servers.stop.is_set():
            try:
                conn, _ = sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                handle(conn)

    servers._spawn(serve, sock)


def recording_server(net, address: str, port: int) -> list[bytes]:  # type: ignore[no-untyped-def]
    """A server at address:port in the fake internet that keeps everything each connection sent
    (read until the client ends its side) and answers `ok`; returns the list it fills."""
    received: list[bytes] = []

    def record(conn: socket.socket) -> None:
        conn.settimeout(5)
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except OSError:
            pass
        received.append(data)
        try:
            conn.sendall(b"ok")
        except OSError:
            pass

    serve_in_internet(net, address, port, record)
    return received


TLS_HOST = "203.0.113.40"  # serves tls.test with a certificate of the fake internet's own CA
UNTRUSTED_HOST = "203.0.113.41"  # serves untrusted.test with a certificate of a CA nobody trusts
RULES_HOST = "203.0.113.60"  # tests/vm/test_vm_http_rules.py's HTTP servers: two names at one (CDN) address
ZONE.update({"tls.test": TLS_HOST, "untrusted.test": UNTRUSTED_HOST, "plain.test": RULES_HOST, "raw.test": RULES_HOST})


def test_ca(label: str):  # type: ignore[no-untyped-def]
    """(key, certificate) of a throw-away CA for the fake internet's TLS servers."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, label)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def server_pem(ca, name: str, path: Path) -> None:  # type: ignore[no-untyped-def]
    """A server certificate for `name` signed by `ca` (a `test_ca`), with its key, in one PEM file at
    `path`: what a TLS server of the fake internet presents, whether tls_server or a real daemon serves it."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def tls_server(ns: str, address: str, port: int, name: str, ca, directory, servers: Servers,  # type: ignore[no-untyped-def]
               handler=None) -> None:
    """A real TLS web server (http.server over ssl) at address:port in `ns`, presenting a certificate
    for `name` signed by `ca`; it answers every request with `<METHOD> <path> <Host>` and keeps the
    connection alive (or with `handler`, an http.server handler class). Runs until `servers` close."""
    import http.server
    import ssl

    pem = directory / f"{name}.pem"
    server_pem(ca, name, pem)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem)

    class Echo(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _echo(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            body = f"{self.command} {self.path} {self.headers.get('Host')}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _echo

        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

    ip("-n", ns, "addr", "add", f"{address}/32", "dev", "lo")
    server = http.server.ThreadingHTTPServer((address, port), handler or Echo, bind_and_activate=False)
    server.socket.close()
    raw = netns.socket_in(ns, socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.socket = context.wrap_socket(raw, server_side=True)
    server.server_bind()
    server.server_activate()
    server.daemon_threads = True

    def serve() -> None:
        while not servers.stop.is_set():
            server.handle_request()

    server.timeout = 0.2
    servers._spawn(serve, server.socket)


def http_server_in(namespace: str, address: str, port: int, handler: type, cleanup: Any) -> None:
    """An HTTP server (`handler`, an http.server handler class) on `address:port` inside `namespace` (the
    address added to its loopback), until `cleanup` (an ExitStack) closes: a package index in a fake internet."""
    import http.server

    ip("-n", namespace, "addr", "replace", f"{address}/32", "dev", "lo")  # one address may serve several ports
    server = http.server.ThreadingHTTPServer((address, port), handler, bind_and_activate=False)
    server.socket.close()
    server.socket = netns.socket_in(namespace, socket.AF_INET, socket.SOCK_STREAM)
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.server_bind()
    server.server_activate()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    cleanup.callback(thread.join)
    cleanup.callback(server.server_close)
    cleanup.callback(server.shutdown)


def tls_internet(prefix: str, directory, cleanup, handler=None):  # type: ignore[no-untyped-def]
    """A fake internet with the two TLS servers (tls.test signed by the CA the slots are told to trust
    as `upstream_ca`, untrusted.test by one nobody trusts; tls.test answers with `handler` if given)
    and a started one-slot pool on it; everything is closed and removed through `cleanup`, an ExitStack.
    Returns (the internet's namespace, the pool)."""
    internet, servers, trusted, ca_file = trusted_internet(prefix, directory, cleanup)
    tls_server(internet, TLS_HOST, 8443, "tls.test", trusted, directory, servers, handler=handler)
    tls_server(internet, UNTRUSTED_HOST, 8443, "untrusted.test", test_ca("nobody's CA"), directory, servers)
    return internet, started_pool(prefix, internet, cleanup, upstream_ca=ca_file)


def trusted_internet(prefix: str, directory: Path, cleanup):  # type: ignore[no-untyped-def]
    """A fake internet (removed, its servers stopped, through `cleanup`, an ExitStack) and the CA its TLS
    servers' certificates come from, which the host is told to trust: (namespace, servers, the CA, its
    certificate's PEM file in `directory`, upstream-ca.pem). The TLS tests add their servers to it."""
    from cryptography.hazmat.primitives import serialization

    internet, servers = build_internet(prefix)
    cleanup.callback(netns.remove, internet)
    cleanup.callback(servers.close)
    trusted = test_ca("fake internet CA")
    ca_file = directory / "upstream-ca.pem"
    ca_file.write_bytes(trusted[1].public_bytes(serialization.Encoding.PEM))
    return internet, servers, trusted, ca_file


def started_pool(prefix: str, internet: str, cleanup, upstream_ca: Path | None = None):  # type: ignore[no-untyped-def]
    """A started one-slot pool (slots `prefix`) on the fake internet `internet`, resolving through its DNS
    server and trusting `upstream_ca` (a PEM file) for the TLS hosts it reads; closed through `cleanup`,
    an ExitStack. What the VM engines of the egress tests are given as their network."""
    from runner.net import NamespaceUplink, SlotPool, Upstream

    pool = SlotPool(prefix, NamespaceUplink(internet), size=1,
                    upstream_ca=None if upstream_ca is None else str(upstream_ca),
                    upstream=Upstream(UPSTREAM_DNS, netns=internet))
    cleanup.callback(pool.close)
    pool.start()
    return pool


def _blob(root: Path, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = root / "blobs" / "sha256" / digest[7:9] / digest[7:] / "data"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def _link(path: Path, digest: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "link").write_text(digest)


def seed_registry(storage: Path, name: str, tag: str) -> None:
    """An image of a static busybox in the registry's own filesystem layout (distribution's storage
    driver paths), as a push would leave it: no Docker on the host needed. The docker-registry tests
    serve it from the fake internet, however their registry authenticates."""
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w") as tar:
        tar.add("/bin/busybox", arcname="bin/busybox")
    layer = gzip.compress(layer_tar.getvalue(), mtime=0)
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Entrypoint": ["/bin/busybox"]},
                         "rootfs": {"type": "layers",
                                    "diff_ids": ["sha256:" + hashlib.sha256(layer_tar.getvalue()).hexdigest()]}}
                        ).encode()
    root = storage / "docker" / "registry" / "v2"
    layer_digest, config_digest = _blob(root, layer), _blob(root, config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config),
                   "digest": config_digest},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": len(layer),
                    "digest": layer_digest}]}).encode()
    manifest_digest = _blob(root, manifest)
    repo = root / "repositories" / name
    for digest in (layer_digest, config_digest):
        _link(repo / "_layers" / "sha256" / digest[7:], digest)
    _link(repo / "_manifests" / "revisions" / "sha256" / manifest_digest[7:], manifest_digest)
    _link(repo / "_manifests" / "tags" / tag / "current", manifest_digest)
    _link(repo / "_manifests" / "tags" / tag / "index" / "sha256" / manifest_digest[7:], manifest_digest)
