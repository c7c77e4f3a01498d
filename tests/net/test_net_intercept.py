"""`methods:` / `paths:` on a host rule over HTTPS: the host terminates TLS with the job's own CA,
verifies the upstream against its trust store (plus `upstream_ca`), and checks every request
(issue 18). A real TLS server in the fake internet, its own test CA, a stand-in guest."""

from __future__ import annotations

import secrets
import socket
import ssl
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

import tests.net.net_fakes as net_fakes
from policy import load_policy
from policy.suggest import REQUEST_REFUSED, UPSTREAM_UNTRUSTED
from runner.net import Slot, SlotPool, netns
from tests.net.net_fakes import TLS_HOST, UNTRUSTED_HOST, in_ns, lookup

POLICY = """\
version: 1
allow:
  - host: tls.test
    ports: [8443]
    methods: [GET]
    paths: ["/simple/*"]
  - host: untrusted.test
    ports: [8443]
    methods: [GET]
  - host: web.test
    ports: [8000]
"""


@dataclass
class Setup:
    slot: Slot
    guest: str
    pool: SlotPool
    tmp: Path


@pytest.fixture
def setup(need_netns, tmp_path: Path) -> Iterator[Setup]:
    prefix = "t" + secrets.token_hex(3)
    with ExitStack() as cleanup:
        cleanup.callback(netns.remove, f"{prefix}-guest")
        _, pool = net_fakes.tls_internet(prefix, tmp_path, cleanup)
        slot = pool.acquire(job="intercepted")
        yield Setup(slot, net_fakes.attach_guest(prefix, slot.netns), pool, tmp_path)
    assert net_fakes.leftovers(prefix) == []


def complete(data: bytes) -> int:
    """How many whole responses (head and Content-Length body) `data` holds."""
    count = 0
    while (end := data.find(b"\r\n\r\n")) >= 0:
        length = next((int(line.split(b":")[1]) for line in data[:end].split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        if len(data) < end + 4 + length:
            break
        data, count = data[end + 4 + length:], count + 1
    return count


def https(s: Setup, name: str, requests: list[str], cafile: Path) -> str:
    """Send `requests` (request lines; Host is `name`) over one TLS connection, as the guest, trusting
    only `cafile`; everything that came back."""

    def run() -> str:
        context = ssl.create_default_context(cafile=str(cafile))
        address = {"tls.test": TLS_HOST, "untrusted.test": UNTRUSTED_HOST}[name]
        with socket.create_connection((address, 8443), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname=name) as tls:
            for line in requests:
                tls.sendall(f"{line} HTTP/1.1\r\nHost: {name}\r\nContent-Length: 0\r\n\r\n".encode())
            got = b""
            try:
                while chunk := tls.recv(65536):
                    got += chunk
                    if complete(got) >= len(requests):
                        break
            except (OSError, ssl.SSLError):
                pass
            return got.decode("utf-8", "replace")

    return in_ns(s.guest, run)


def test_methods_and_paths_are_checked_inside_tls_with_the_jobs_own_ca(setup: Setup) -> None:
    s = setup
    s.slot.apply_policy(load_policy(POLICY, "p.yml"))
    assert s.slot.proxy is not None and s.slot.proxy.ca is not None
    job_ca = s.tmp / "job-ca.pem"
    job_ca.write_bytes(s.slot.proxy.ca.cert_pem)  # what Sandbox.install_job_ca puts into a VM
    assert lookup(s.guest, "tls.test") is not None and lookup(s.guest, "untrusted.test") is not None

    ok = https(s, "tls.test", ["GET /simple/demo/"], job_ca)
    assert ok.startswith("HTTP/1.1 200") and ok.endswith("GET /simple/demo/ tls.test"), ok
    two = https(s, "tls.test", ["GET /simple/a/", "GET /simple/b/"], job_ca)  # kept alive, both checked
    assert two.count("HTTP/1.1 200") == 2, two
    post = https(s, "tls.test", ["POST /simple/x"], job_ca)
    assert post.startswith("HTTP/1.1 403") and "POST /simple/x on tls.test is not allowed" in post, post
    upload = https(s, "tls.test", ["GET /simple/ok/", "GET /upload"], job_ca)
    assert upload.count("HTTP/1.1 200") == 1 and "GET /upload on tls.test is not allowed" in upload, upload
    sneaky = https(s, "tls.test", ["GET /simple/../upload"], job_ca)
    assert sneaky.startswith("HTTP/1.1 403"), sneaky
    bad = https(s, "untrusted.test", ["GET /"], job_ca)
    assert bad.startswith("HTTP/1.1 502") and "certificate of untrusted.test failed verification" in bad, bad

    records = {(r.name, r.reason, r.method, r.path) for r in s.slot.audit_records()}
    assert {("tls.test", REQUEST_REFUSED, "POST", "/simple/*"), ("tls.test", REQUEST_REFUSED, "GET", "/upload"),
            ("untrusted.test", UPSTREAM_UNTRUSTED, None, None)} <= records, records

    with pytest.raises(ssl.SSLCertVerificationError):  # the guest trusts only what it was given
        in_ns(s.guest, lambda: ssl.create_default_context().wrap_socket(
            socket.create_connection((TLS_HOST, 8443), timeout=5), server_hostname="tls.test"))


def test_each_job_gets_its_own_ca_and_loses_it_with_the_slot(setup: Setup) -> None:
    s = setup
    s.slot.apply_policy(load_policy(POLICY, "p.yml"))
    first = s.slot.proxy.ca if s.slot.proxy is not None else None
    assert first is not None
    s.pool.release(s.slot)
    assert s.slot.proxy is not None and s.slot.proxy.ca is None
    again = s.pool.acquire(job="next")
    again.apply_policy(load_policy(POLICY, "p.yml"))
    assert again.proxy is not None and again.proxy.ca is not None
    assert again.proxy.ca.cert_pem != first.cert_pem
    again.apply_policy(load_policy("version: 1\nallow:\n  - host: tls.test\n    ports: [8443]\n", "p.yml"))
    assert again.proxy.ca is None  # no methods:/paths: rule: nothing is intercepted, no CA exists



def test_a_client_that_closes_after_one_request_gets_its_whole_response(setup: Setup) -> None:
    """urllib's way: HTTP/1.1 with Connection: close, then read to the end."""
    s = setup
    s.slot.apply_policy(load_policy(POLICY, "p.yml"))
    assert s.slot.proxy is not None and s.slot.proxy.ca is not None
    job_ca = s.tmp / "job-ca.pem"
    job_ca.write_bytes(s.slot.proxy.ca.cert_pem)
    lookup(s.guest, "tls.test")

    def fetch() -> bytes:
        context = ssl.create_default_context(cafile=str(job_ca))
        with socket.create_connection((TLS_HOST, 8443), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname="tls.test") as tls:
            tls.sendall(b"GET /simple/x/ HTTP/1.1\r\nHost: tls.test:8443\r\nAccept-Encoding: identity\r\n"
                        b"Connection: close\r\n\r\n")
            got = b""
            while chunk := tls.recv(65536):
                got += chunk
            return got

    assert in_ns(s.guest, fetch).endswith(b"\r\n\r\nGET /simple/x/ tls.test:8443")
