"""The host-side name check on real namespaces: a `host:` rule admits a TCP connection only when its
TLS SNI or HTTP Host is that name, at an address the resolver handed out for it (issue 18).

The fake internet's hosts serve many names at one address, as a CDN does: `web.test` and
`a.cdn.test` both resolve to ALLOWED_HOST, so only the name tells them apart.
"""

from __future__ import annotations

import socket
import ssl
import struct

import pytest

import tests.net.net_fakes as net_fakes
from policy import load_policy
from policy.suggest import NAME_REFUSED, REQUEST_REFUSED, UNNAMED
from runner.net import nameproxy
from tests.net.net_fakes import ALLOWED_HOST, DENIED_HOST, in_ns, lookup, reach

WEB = "version: 1\nmode: {mode}\nallow:\n  - host: web.test\n    ports: [8000]\n"
BANNER = f"{ALLOWED_HOST}:8000".encode()


def policy(text: str, mode: str = "block"):  # type: ignore[no-untyped-def]
    return load_policy(text.format(mode=mode), "test-policy.yml")


def hello(sni: str | None) -> bytes:
    """A real ClientHello from Python's TLS stack (SNI `sni`, or none)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=sni)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def with_extension(record: bytes, kind: int, value: bytes = b"\x00") -> bytes:
    """`record` (one ClientHello record) with one more extension appended, lengths fixed up."""
    body = record[9:]
    at = 2 + 32
    at += 1 + body[at]
    at += 2 + struct.unpack_from("!H", body, at)[0]
    at += 1 + body[at]
    (ext_len,) = struct.unpack_from("!H", body, at)
    extra = struct.pack("!HH", kind, len(value)) + value
    body = body[:at] + struct.pack("!H", ext_len + len(extra)) + body[at + 2:] + extra
    handshake = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


def send(guest: str, address: str, port: int, data: bytes, timeout: float = 3.0) -> bytes | None:
    """What the guest gets back after sending `data` (None: reset or nothing)."""

    def run() -> bytes | None:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.sendall(data)
            try:
                got = sock.recv(100)
            except OSError:
                return None
            return got or None

    return in_ns(guest, run)


def http(name: str) -> bytes:
    return f"GET / HTTP/1.1\r\nHost: {name}\r\n\r\n".encode()


def refusals(slot) -> set[tuple[str, int, str | None, str]]:  # type: ignore[no-untyped-def]
    return {(r.dest, r.port, r.name, r.reason) for r in slot.audit_records() if r.reason in (NAME_REFUSED, UNNAMED)}


def test_one_address_two_names_over_http_and_tls(slot, guest) -> None:
    slot.apply_policy(policy(WEB))
    assert lookup(guest, "web.test") is not None

    assert send(guest, ALLOWED_HOST, 8000, http("web.test")) == BANNER
    assert send(guest, ALLOWED_HOST, 8000, http("WEB.test.")) == BANNER  # case and trailing dot normalised
    assert send(guest, ALLOWED_HOST, 8000, hello("web.test")) == BANNER
    assert send(guest, ALLOWED_HOST, 8000, http("a.cdn.test")) is None  # same address, another name
    assert send(guest, ALLOWED_HOST, 8000, hello("evil.cdn.test")) is None
    assert refusals(slot) == {(ALLOWED_HOST, 8000, "a.cdn.test", NAME_REFUSED),
                              (ALLOWED_HOST, 8000, "evil.cdn.test", NAME_REFUSED)}


def test_no_sni_ech_and_neither_tls_nor_http_are_refused(slot, guest, monkeypatch) -> None:
    monkeypatch.setattr(nameproxy, "FIRST_FLIGHT_SECONDS", 1.0)
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")

    assert send(guest, ALLOWED_HOST, 8000, hello(None)) is None
    assert send(guest, ALLOWED_HOST, 8000, with_extension(hello("web.test"), 0xFE0D)) is None
    assert send(guest, ALLOWED_HOST, 8000, b"SSH-2.0-OpenSSH_9.2\r\n") is None
    assert send(guest, ALLOWED_HOST, 8000, b"\x00\x01binary") is None
    assert not reach(guest, ALLOWED_HOST, 8000)  # says nothing: refused when its time is up
    assert refusals(slot) == {(ALLOWED_HOST, 8000, None, UNNAMED), (ALLOWED_HOST, 8000, "web.test", UNNAMED)}


def test_a_name_allowed_elsewhere_is_refused_at_another_names_address(slot, guest) -> None:
    slot.apply_policy(policy(WEB + "  - host: denied.test\n    ports: [8000]\n"))
    lookup(guest, "web.test")
    lookup(guest, "denied.test")

    assert send(guest, DENIED_HOST, 8000, http("denied.test")) == f"{DENIED_HOST}:8000".encode()
    assert send(guest, ALLOWED_HOST, 8000, http("denied.test")) is None  # allowed, but not handed out here
    assert send(guest, DENIED_HOST, 8000, hello("web.test")) is None


def test_a_second_request_naming_another_host_never_reaches_the_server(net, slot, guest) -> None:
    received = net_fakes.recording_server(net, ALLOWED_HOST, 8080)
    slot.apply_policy(policy("version: 1\nallow:\n  - host: web.test\n    ports: [8080]\n"))
    lookup(guest, "web.test")
    first = b"POST /a HTTP/1.1\r\nHost: web.test\r\nContent-Length: 5\r\n\r\nHost:"
    second = b"GET /b HTTP/1.1\r\nHost: evil.test\r\n\r\n"

    def pipelined(chunks: list[bytes]) -> bytes:
        def run() -> bytes:
            with socket.create_connection((ALLOWED_HOST, 8080), timeout=5) as sock:
                for chunk in chunks:
                    sock.sendall(chunk)
                sock.shutdown(socket.SHUT_WR)
                return sock.recv(100)
        return in_ns(guest, run)

    assert pipelined([first + second]) == b"ok"
    assert pipelined([first[:7], first[7:30], first[30:] + second[:20], second[20:]]) == b"ok"  # split anyhow
    # a request with a body goes out as the connection's last (Connection: close); the one after is
    # still checked (and recorded), never passed on
    forwarded = first.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    assert received == [forwarded, forwarded]
    assert (ALLOWED_HOST, 8080, "evil.test", NAME_REFUSED) in refusals(slot)


def test_cidr_and_raw_rules_keep_address_semantics(slot, guest) -> None:
    slot.apply_policy(policy(f"version: 1\nallow:\n  - cidr: {DENIED_HOST}/32\n    ports: [8000]\n"
                             "  - host: web.test\n    ports: [8000]\n    raw: true\n"))
    lookup(guest, "web.test")

    assert reach(guest, DENIED_HOST, 8000)  # server speaks first: no name is needed or read
    assert reach(guest, ALLOWED_HOST, 8000)
    assert refusals(slot) == set()


def test_a_raw_host_at_a_checked_hosts_address_and_port_does_not_cancel_the_check(slot, guest) -> None:
    """web.test (raw) and a.cdn.test (paths:) share ALLOWED_HOST:8000, as two sites on one CDN address:
    the stricter wins there, so a request outside a.cdn.test's paths is refused, whatever name it uses."""
    slot.apply_policy(policy("version: 1\nallow:\n  - host: web.test\n    ports: [8000, 9000]\n    raw: true\n"
                             '  - host: a.cdn.test\n    ports: [8000]\n    paths: ["/ok/*"]\n'))
    lookup(guest, "web.test")
    lookup(guest, "a.cdn.test")

    assert send(guest, ALLOWED_HOST, 8000, b"GET /ok/x HTTP/1.1\r\nHost: a.cdn.test\r\n\r\n") == BANNER
    refused = send(guest, ALLOWED_HOST, 8000, b"GET /upload HTTP/1.1\r\nHost: a.cdn.test\r\n\r\n")
    assert refused is not None and refused.startswith(b"HTTP/1.1 403"), refused
    assert send(guest, ALLOWED_HOST, 8000, http("web.test")) is None  # the raw name gives way on the shared port
    assert reach(guest, ALLOWED_HOST, 9000)  # ... and keeps address semantics on its own
    assert {(r.name, r.reason, r.method, r.path) for r in slot.audit_records() if r.port == 8000} == {
        ("a.cdn.test", REQUEST_REFUSED, "GET", "/upload"), ("web.test", NAME_REFUSED, "GET", "/")}


def test_audit_mode_lets_a_wrong_name_through_and_records_it(slot, guest) -> None:
    slot.apply_policy(policy(WEB, mode="audit"))
    lookup(guest, "web.test")

    assert send(guest, ALLOWED_HOST, 8000, http("collector.evil.test")) == BANNER
    assert refusals(slot) == {(ALLOWED_HOST, 8000, "collector.evil.test", NAME_REFUSED)}


def test_a_released_slot_ends_its_checked_connections(net, slot, guest) -> None:
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")

    def hold() -> socket.socket:
        sock = socket.create_connection((ALLOWED_HOST, 8000), timeout=3)
        sock.sendall(http("web.test"))
        assert sock.recv(100) == BANNER
        return sock

    sock = in_ns(guest, hold)
    with sock:
        assert slot.proxy is not None
        net.pool.release(slot)
        assert slot.proxy.connections == set()


def test_the_summary_names_what_the_name_check_refused(slot, guest) -> None:
    from action.summary import Result, markdown
    from tests.action.job_records import job_record

    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")
    assert send(guest, ALLOWED_HOST, 8000, http("collector.evil.test")) is None
    record = job_record({"id": "j", "exit_code": 0, "blocked_egress": [r.to_wire() for r in slot.audit_records()]})
    text = markdown(Result(record=record, exit_code=0, junit=None, artifacts=[], refused_artifacts=[]))
    row = next(line for line in text.splitlines() if "collector.evil.test" in line and line.startswith("|"))
    assert "TLS SNI / HTTP Host (name) is not allowed at that address" in row
    assert "host: collector.evil.test" not in text  # a refused name is explained, never suggested as a rule


def test_methods_and_paths_on_plain_http_are_checked_request_by_request(slot, guest) -> None:
    slot.apply_policy(policy('version: 1\nallow:\n  - host: web.test\n    ports: [8000]\n    methods: [GET]\n'
                             '    paths: ["/ok/*"]\n'))
    lookup(guest, "web.test")

    assert send(guest, ALLOWED_HOST, 8000, b"GET /ok/x?q=1 HTTP/1.1\r\nHost: web.test\r\n\r\n") == BANNER
    refused = send(guest, ALLOWED_HOST, 8000, b"POST /ok/x HTTP/1.1\r\nHost: web.test\r\nContent-Length: 0\r\n\r\n")
    assert refused is not None and refused.startswith(b"HTTP/1.1 403")
    assert send(guest, ALLOWED_HOST, 8000, b"GET /secret HTTP/1.1\r\nHost: web.test\r\n\r\n", ).startswith(b"HTTP/1.1 403")
    for odd in (b"GeT", b"HeaD"):  # methods are case-sensitive: a server may read these as GET and HEAD, or not
        answer = send(guest, ALLOWED_HOST, 8000, odd + b" /ok/x HTTP/1.1\r\nHost: web.test\r\n\r\n")
        assert answer is not None and answer.startswith(b"HTTP/1.1 403"), (odd, answer)
    assert slot.proxy is not None and slot.proxy.ca is not None  # HTTPS to such a rule would need it
    found = {(r.method, r.path) for r in slot.audit_records() if r.reason == "request-refused"}
    assert found == {("POST", "/ok/*"), ("GET", "/secret"), ("GeT", "/ok/*"), ("HeaD", "/ok/*")}


def test_the_checker_is_reachable_only_through_the_redirect_and_bounded_per_vm(slot, guest, monkeypatch) -> None:
    from runner.net import addresses

    monkeypatch.setattr(nameproxy, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(nameproxy, "FIRST_FLIGHT_SECONDS", 3.0)
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")
    assert not reach(guest, addresses.GATEWAY_IP, addresses.NAMECHECK_PORT)  # dialled directly: the guard drops it

    def flood() -> list[bytes | None]:
        held = [socket.create_connection((ALLOWED_HOST, 8000), timeout=3) for _ in range(2)]  # silent: held open
        try:  # the reset may come in the connect, before the send (the checker refuses at accept) or after it
            with socket.create_connection((ALLOWED_HOST, 8000), timeout=3) as third:
                third.sendall(http("web.test"))
                return [third.recv(100) or None]
        except (ConnectionResetError, BrokenPipeError):
            return [None]
        finally:
            for sock in held:
                sock.close()

    assert in_ns(guest, flood) == [None]  # the third of two allowed at once is reset, named or not
    assert (ALLOWED_HOST, 8000, None, UNNAMED) in refusals(slot)


def test_audit_mode_records_whether_a_connection_no_rule_covers_named_itself(slot, guest) -> None:
    """Audit mode, no rule: the name check still sees each connection, so the record says what block
    mode would need: a host rule for a TLS/HTTP one that names the name it dialled, `raw: true` for
    one that names nothing (the server spoke first, as the banner servers do)."""
    from policy.suggest import POLICY, suggest_policy

    slot.apply_policy(policy("version: 1\nmode: audit\nallow: []\n"))
    lookup(guest, "web.test")
    lookup(guest, "denied.test")

    assert reach(guest, DENIED_HOST, 8000)  # server first: let through at once, not after the first-flight wait
    assert send(guest, ALLOWED_HOST, 9000, hello("web.test")) == f"{ALLOWED_HOST}:9000".encode()
    records = {(r.dest, r.port, r.name, r.reason, r.unnamed) for r in slot.audit_records()}
    assert (DENIED_HOST, 8000, "denied.test", POLICY, True) in records
    assert (ALLOWED_HOST, 9000, "web.test", POLICY, False) in records
    suggested = policy(suggest_policy(slot.audit_records()))
    assert sorted((r.host, sorted(r.ports), r.raw) for r in suggested.rules) == [
        ("denied.test", [8000], True), ("web.test", [9000], False)]
