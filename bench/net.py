"""Benchmark of per-VM networking: slot set-up, teardown, release, the cost of a policy, and the
host's name check (issue 18) against an address-only rule, measured in the same run.

Needs root. Everything happens in namespaces this script makes (prefix `bn<random>`), attached to
an uplink namespace of its own; no packet leaves them. Prints medians and p99 per measurement and,
last, one JSON line with the headline numbers.

The name check is measured from a stand-in guest (a namespace whose veth takes the slot's tap0
name, as tests/net does) to a server in the uplink namespace, once through a `cidr:` rule (the
kernel forwards it) and once through a `host:` rule (redirected to `runner.net.nameproxy`, which
reads the ClientHello, checks the SNI and then splices): `name_check_connect_*` is connect, send a
ClientHello and get the first reply byte; `sni_throughput_ratio` one large download through the
checked connection over the same through the address-only one; `intercept_throughput_ratio` one
large HTTPS download through a `methods:` rule (the host terminates TLS with the job's CA and
verifies the server's) over the same HTTPS download through an address-only rule;
`secret_scan_throughput_ratio` the same intercepted download with a secret bound to the host (issue
35: the host swaps the value into the request and scans the whole response for it) over the
intercepted one without, downloads interleaved. Goals (issue 18): added connect p50 <= 3 ms, SNI
ratio >= 0.9, intercept ratio >= 0.5; (issue 35) secret scan ratio >= 0.8.

    .venv/bin/python bench/net.py [--runs 40]

`--smoke` (the test suite's run, tests/test_bench_smoke.py): 3 runs of each, no goal judged.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shutil
import socket
import ssl
import subprocess
import tempfile
import threading

from dnslib import QTYPE, RR, A, DNSRecord

from bench.stats import percentile
from policy import load_policy
from runner.net import NamespaceUplink, SlotPool, Upstream, addresses, netns
from runner.net.secretswap import BoundSecret, SecretBinding, SecretSwap

POLICY = """\
version: 1
mode: block
allow:
  - host: pypi.org
    ports: [443]
  - host: "*.pythonhosted.org"
    ports: [443]
  - host: github.com
    ports: [22, 443]
  - cidr: 10.20.0.0/16
    ports: [80, 443]
  - cidr: 203.0.113.0/24
    ports: [53]
    protocol: udp
"""


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return (time.perf_counter() - start) * 1000, result


def report(name: str, samples: list[float]) -> tuple[float, float]:
    """Print one measurement; its p50 (median) and p99."""
    median, p99 = statistics.median(samples), percentile(samples, 0.99)
    print(f"{name:<28} p50 {median:7.2f} ms   p99 {p99:7.2f} ms   n={len(samples)}")
    return median, p99


SERVER = "203.0.113.10"
DNS = "203.0.113.53"
NAME = "bench.test"
CHECKED_PORT, ADDRESS_PORT = 443, 8443
TLS_DIRECT_PORT, TLS_INTERCEPT_PORT = 9443, 10443
NAME_POLICY = f"""\
version: 1
allow:
  - host: {NAME}
    ports: [{CHECKED_PORT}]
  - cidr: {SERVER}/32
    ports: [{ADDRESS_PORT}, {TLS_DIRECT_PORT}]
  - host: {NAME}
    ports: [{TLS_INTERCEPT_PORT}]
    methods: [GET]
    paths: ["/big/*"]
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _hello() -> bytes:
    context = ssl.create_default_context()
    out = ssl.MemoryBIO()
    tls = context.wrap_bio(ssl.MemoryBIO(), out, server_hostname=NAME)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()


class _Servers:
    """In the uplink namespace: a DNS answering NAME, and on both ports a server that, after the
    client's first bytes, sends one byte (latency) or `size` bytes (download) as the client asks."""

    def __init__(self, ns: str, request_bytes: int) -> None:
        self.request_bytes = request_bytes  # a ClientHello and 12 digits: how many bytes to send back
        self.stop = threading.Event()
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        dns = netns.socket_in(ns, socket.AF_INET, socket.SOCK_DGRAM)
        dns.bind((DNS, 53))
        self._start(dns, self._dns)
        for port in (CHECKED_PORT, ADDRESS_PORT):
            tcp = netns.socket_in(ns, socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((SERVER, port))
            tcp.listen(64)
            self._start(tcp, self._tcp)

    def _start(self, sock: socket.socket, serve: Callable[[socket.socket], None]) -> None:
        sock.settimeout(0.2)
        self.sockets.append(sock)
        thread = threading.Thread(target=serve, args=(sock,), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _dns(self, sock: socket.socket) -> None:
        while not self.stop.is_set():
            try:
                data, peer = sock.recvfrom(4096)
            except OSError:
                continue
            query = DNSRecord.parse(data)
            reply = query.reply()
            if str(query.q.qname).rstrip(".") == NAME and query.q.qtype == QTYPE.A:
                reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A(SERVER), ttl=300))
            sock.sendto(reply.pack(), peer)

    def _tcp(self, sock: socket.socket) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def serve_tls(self, ns: str, context: ssl.SSLContext) -> None:
        """On both TLS ports: HTTPS whose GET /big/<n> answers n bytes."""
        for port in (TLS_DIRECT_PORT, TLS_INTERCEPT_PORT):
            tcp = netns.socket_in(ns, socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((SERVER, port))
            tcp.listen(16)
            self._start(tcp, lambda sock: self._tls(sock, context))

    def _tls(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._https, args=(conn, context), daemon=True).start()

    @staticmethod
    def _https(conn: socket.socket, context: ssl.SSLContext) -> None:
        try:
            conn.settimeout(30)
            with context.wrap_socket(conn, server_side=True) as tls:
                head = b""
                while b"\r\n\r\n" not in head and (chunk := tls.recv(4096)):
                    head += chunk
                size = int(head.split(b" ", 2)[1].rsplit(b"/", 1)[1])
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % size)
                block = memoryview(bytes(1 << 20))
                while size > 0:
                    size -= tls.send(block[:min(size, len(block))])
        except (OSError, ValueError, IndexError):
            conn.close()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10)
                first = b""
                while len(first) < self.request_bytes and (chunk := conn.recv(65536)):
                    first += chunk
                size = int(first[-12:])
                block = memoryview(bytes(1 << 20))
                while size > 0:
                    sent = conn.send(block[:min(size, len(block))])
                    size -= sent
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        for sock in self.sockets:
            sock.close()


def _attach_guest(prefix: str, slot_ns: str) -> str:
    """The stand-in guest: a namespace whose eth0 is the other end of a veth named tap0 in the slot."""
    guest = f"{prefix}-guest"
    netns.create(guest)
    _ip("-n", slot_ns, "link", "del", addresses.TAP_NAME)
    _ip("-n", slot_ns, "link", "add", addresses.TAP_NAME, "type", "veth", "peer", "name", "eth0", "netns", guest)
    _ip("-n", slot_ns, "addr", "add", f"{addresses.GATEWAY_IP}/{addresses.GUEST_PREFIXLEN}", "dev", addresses.TAP_NAME)
    _ip("-n", slot_ns, "link", "set", addresses.TAP_NAME, "up")
    _ip("-n", guest, "link", "set", "lo", "up")
    _ip("-n", guest, "link", "set", "eth0", "address", addresses.GUEST_MAC)
    _ip("-n", guest, "addr", "add", f"{addresses.GUEST_IP}/{addresses.GUEST_PREFIXLEN}", "dev", "eth0")
    _ip("-n", guest, "link", "set", "eth0", "up")
    _ip("-n", guest, "route", "add", "default", "via", addresses.GATEWAY_IP)
    return guest


def _connect_ms(port: int, hello: bytes) -> float:
    start = time.perf_counter()
    with socket.create_connection((SERVER, port), timeout=10) as sock:
        sock.sendall(hello + b"%012d" % 1)
        if not sock.recv(1):
            raise RuntimeError(f"no reply through port {port}")
    return (time.perf_counter() - start) * 1000


def _download_mb_s(port: int, hello: bytes, size: int) -> float:
    start = time.perf_counter()
    got = 0
    with socket.create_connection((SERVER, port), timeout=30) as sock:
        sock.sendall(hello + b"%012d" % size)
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
    if got != size:
        raise RuntimeError(f"downloaded {got} of {size} bytes through port {port}")
    return size / (1 << 20) / (time.perf_counter() - start)


def _https_mb_s(port: int, context: ssl.SSLContext, size: int, header: str = "") -> float:
    start = time.perf_counter()
    got = b""
    with socket.create_connection((SERVER, port), timeout=60) as raw, context.wrap_socket(raw, server_hostname=NAME) as tls:
        tls.sendall(f"GET /big/{size} HTTP/1.1\r\nHost: {NAME}\r\n{header}\r\n".encode())
        while b"\r\n\r\n" not in got:
            got += tls.recv(65536)
        body = len(got) - got.index(b"\r\n\r\n") - 4
        while body < size and (chunk := tls.recv(1 << 20)):
            body += len(chunk)
    if body != size:
        raise RuntimeError(f"downloaded {body} of {size} bytes over HTTPS through port {port}")
    return size / (1 << 20) / (time.perf_counter() - start)


def _bench_ca(directory: Path) -> tuple[ssl.SSLContext, Path]:
    """A throw-away CA and a server certificate for NAME: the server's context and the CA's PEM file."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAME)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(NAME)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = directory / "server.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pem)
    return context, ca_file


def name_check(runs: int, size: int) -> dict[str, float]:
    """Connect latency and download throughput, name-checked against address-only, same run."""
    prefix = "bn" + secrets.token_hex(3)
    uplink_ns = f"{prefix}-up"
    netns.create(uplink_ns)
    servers: _Servers | None = None
    scratch = Path(tempfile.mkdtemp(prefix="mvc-bench-"))
    server_tls, ca_file = _bench_ca(scratch)
    pool = SlotPool(prefix, NamespaceUplink(uplink_ns), size=0, upstream=Upstream(DNS, netns=uplink_ns),
                    upstream_ca=str(ca_file))
    try:
        _ip("-n", uplink_ns, "link", "set", "lo", "up")
        for address in (SERVER, DNS):
            _ip("-n", uplink_ns, "addr", "add", f"{address}/32", "dev", "lo")
        hello = _hello()
        servers = _Servers(uplink_ns, len(hello) + 12)
        servers.serve_tls(uplink_ns, server_tls)
        pool.start()
        slot = pool.acquire(job="bench")
        guest = _attach_guest(prefix, slot.netns)
        slot.apply_policy(load_policy(NAME_POLICY, "bench-name-policy.yml"))
        assert slot.proxy is not None and slot.proxy.ca is not None
        (scratch / "job-ca.pem").write_bytes(slot.proxy.ca.cert_pem)
        client_tls = ssl.create_default_context(cafile=str(ca_file))  # the guest: the server's CA and the job's
        client_tls.load_verify_locations(cafile=str(scratch / "job-ca.pem"))
        binding = SecretBinding("bench", "BENCH_TOKEN", NAME, ports=frozenset({TLS_INTERCEPT_PORT}), paths=("/big/*",))
        swap = SecretSwap((BoundSecret.make(binding, "bench-" + secrets.token_hex(20)),))

        def measure() -> dict[str, float]:
            query = DNSRecord.question(NAME, "A")
            DNSRecord.parse(query.send(addresses.DNS_IP, addresses.DNS_PORT, timeout=5))
            checked, direct, checked_rate, direct_rate = [], [], [], []
            for _ in range(runs):  # interleaved, so drift hits both alike
                direct.append(_connect_ms(ADDRESS_PORT, hello))
                checked.append(_connect_ms(CHECKED_PORT, hello))
            https_direct, https_intercepted, https_scanned = [], [], []
            for _ in range(3):
                direct_rate.append(_download_mb_s(ADDRESS_PORT, hello, size))
                checked_rate.append(_download_mb_s(CHECKED_PORT, hello, size))
                https_direct.append(_https_mb_s(TLS_DIRECT_PORT, client_tls, size))
                https_intercepted.append(_https_mb_s(TLS_INTERCEPT_PORT, client_tls, size))
                slot.bind_secrets(swap)
                https_scanned.append(_https_mb_s(TLS_INTERCEPT_PORT, client_tls, size,
                                                 f"Authorization: Bearer {swap.secrets[0].placeholder}\r\n"))
                slot.bind_secrets(SecretSwap(()))
            address_p50, _ = report("connect, address-only rule", direct)
            name_p50, name_p99 = report("connect, name-checked rule", checked)
            ratio = statistics.median(checked_rate) / statistics.median(direct_rate)
            print(f"{'download, address-only':<28} {statistics.median(direct_rate):8.1f} MiB/s")
            print(f"{'download, SNI-checked':<28} {statistics.median(checked_rate):8.1f} MiB/s")
            print(f"{'HTTPS, address-only':<28} {statistics.median(https_direct):8.1f} MiB/s")
            print(f"{'HTTPS, intercepted':<28} {statistics.median(https_intercepted):8.1f} MiB/s")
            print(f"{'HTTPS, secret bound':<28} {statistics.median(https_scanned):8.1f} MiB/s")
            return {"address_connect_p50_ms": round(address_p50, 2), "name_check_connect_p50_ms": round(name_p50, 2),
                    "name_check_connect_p99_ms": round(name_p99, 2),
                    "name_check_added_connect_p50_ms": round(name_p50 - address_p50, 2),
                    "sni_throughput_ratio": round(ratio, 2),
                    "intercept_throughput_ratio": round(statistics.median(https_intercepted)
                                                        / statistics.median(https_direct), 2),
                    "secret_scan_throughput_ratio": round(statistics.median(https_scanned)
                                                          / statistics.median(https_intercepted), 2)}

        return netns.run_in(guest, measure)
    finally:
        pool.close()
        netns.remove(f"{prefix}-guest")
        if servers is not None:
            servers.close()
        netns.remove(uplink_ns)
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    parser.add_argument("--download-mb", type=int, default=256, help="size of the throughput download")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.download_mb = 3, 4
    prefix = "bn" + secrets.token_hex(3)
    uplink_ns = f"{prefix}-up"
    policy = load_policy(POLICY, "bench-policy.yml")
    netns.create(uplink_ns)
    pool = SlotPool(prefix, NamespaceUplink(uplink_ns), size=0, upstream=Upstream("192.0.2.53"))
    setup, teardown, ready, release = [], [], [], []
    try:
        pool.start()
        for _ in range(args.runs):
            ms, slot = timed(pool.acquire)  # empty pool: acquire creates the slot
            setup.append(ms)
            teardown.append(timed(lambda: pool.discard(slot))[0])
        slot = pool.acquire()
        pool.release(slot)
        for _ in range(args.runs):
            slot = pool.acquire()
            ready.append(timed(lambda: slot.apply_policy(policy))[0])
            release.append(timed(lambda: pool.release(slot))[0])
    finally:
        pool.close()
        netns.remove(uplink_ns)
    results: dict[str, float] = {}
    for key, name, samples in (("slot_setup", "slot setup", setup), ("slot_teardown", "slot teardown", teardown),
                               ("policy_ready_cost", "policy on pooled slot", ready),
                               ("slot_release", "slot release (clean-up)", release)):
        p50, p99 = report(name, samples)
        results[f"{key}_p50_ms"] = round(p50, 2)
        results[f"{key}_p99_ms"] = round(p99, 2)
    # Same-run ratio: what a pooled slot saves, a fresh slot's set-up against applying a policy to a pooled one.
    results["setup_vs_policy_ratio"] = round(statistics.median(setup) / statistics.median(ready), 1)
    results.update(name_check(args.runs, args.download_mb << 20))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
