"""The name check's own bounds and its following of a kept-alive connection (runner/net/nameproxy.py),
on real namespaces: a guest that says nothing is cut off when FIRST_FLIGHT_SECONDS are up, not held;
past MAX_CONNECTIONS a new connection is reset at once; a request sent after the first one's answer
on the same connection is checked like the first; releasing the slot ends a connection that the
server keeps open; a bug the guest's bytes run into (anything raised but OSError) refuses and records
the connection instead of killing its thread unrecorded.

The keep-alive server here answers every request on a connection and keeps it open until the client
closes it, unlike the fake internet's banner servers (which close after their banner).
"""

from __future__ import annotations

import socket
import time

from policy.suggest import NAME_REFUSED, UNNAMED
from runner.net import nameproxy
from tests.net.net_fakes import ALLOWED_HOST, in_ns, lookup, serve_in_internet
from tests.net.test_net_namecheck import policy, refusals

PORT = 8081
WEB = f"version: 1\nallow:\n  - host: web.test\n    ports: [{PORT}]\n"
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def keepalive_server(net) -> list[bytes]:  # type: ignore[no-untyped-def]
    """An HTTP/1.1 server at ALLOWED_HOST:PORT in the fake internet; returns the request heads it got."""
    heads: list[bytes] = []
    servers = net.servers

    def answer_each(conn: socket.socket) -> None:
        conn.settimeout(0.2)
        data = b""
        while not servers.stop.is_set():
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            data += chunk
            while b"\r\n\r\n" in data:
                head, data = data.split(b"\r\n\r\n", 1)
                heads.append(head)
                conn.sendall(OK)

    serve_in_internet(net, ALLOWED_HOST, PORT, answer_each)
    return heads


def ended(sock: socket.socket, within: float) -> bool:
    """Whether the connection is closed or reset by the other side within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(100) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_guest_that_says_nothing_is_cut_off_when_its_first_flight_time_is_up(slot, guest, monkeypatch) -> None:
    monkeypatch.setattr(nameproxy, "FIRST_FLIGHT_SECONDS", 1.0)
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")

    def silent() -> tuple[bool, float]:
        with socket.create_connection((ALLOWED_HOST, PORT), timeout=3) as sock:
            start = time.monotonic()
            return ended(sock, 8.0), time.monotonic() - start

    cut, after = in_ns(guest, silent)
    assert cut and after < 6.0, f"a silent connection was held {after:.1f} s"
    assert refusals(slot) == {(ALLOWED_HOST, PORT, None, UNNAMED)}


def test_past_the_connection_cap_a_new_connection_is_reset_at_once(net, slot, guest, monkeypatch) -> None:
    keepalive_server(net)
    monkeypatch.setattr(nameproxy, "MAX_CONNECTIONS", 2)
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")
    proxy = slot.proxy
    assert proxy is not None

    def settle(count: int) -> None:
        deadline = time.monotonic() + 5
        while len(proxy.connections) != count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(proxy.connections) == count

    def run() -> tuple[bool, bytes]:
        held = [socket.create_connection((ALLOWED_HOST, PORT), timeout=3) for _ in range(2)]  # silent: in the check
        try:
            settle(2)
            try:
                with socket.create_connection((ALLOWED_HOST, PORT), timeout=3) as third:
                    refused = ended(third, 3.0)  # FIRST_FLIGHT_SECONDS is 10: only the cap ends it this soon
            except ConnectionResetError:
                refused = True  # reset before connect() even returned
        finally:
            for sock in held:
                sock.close()
        settle(0)
        with socket.create_connection((ALLOWED_HOST, PORT), timeout=3) as later:
            later.sendall(b"GET / HTTP/1.1\r\nHost: web.test\r\n\r\n")
            return refused, later.recv(100)

    refused, answer = in_ns(guest, run)
    assert refused
    assert answer == OK  # the cap counts open connections only: room again once they closed
    assert (ALLOWED_HOST, PORT, None, UNNAMED) in refusals(slot)


def test_a_request_after_the_first_answer_on_a_kept_alive_connection_is_checked(net, slot, guest) -> None:
    heads = keepalive_server(net)
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")

    def run() -> tuple[bytes, bool]:
        with socket.create_connection((ALLOWED_HOST, PORT), timeout=3) as sock:
            sock.sendall(b"GET /a HTTP/1.1\r\nHost: web.test\r\n\r\n")
            first = sock.recv(100)
            sock.sendall(b"GET /b HTTP/1.1\r\nHost: collector.evil.test\r\n\r\n")
            return first, ended(sock, 3.0)

    first, cut = in_ns(guest, run)
    assert first == OK and cut
    assert heads == [b"GET /a HTTP/1.1\r\nHost: web.test"]
    assert (ALLOWED_HOST, PORT, "collector.evil.test", NAME_REFUSED) in {
        (r.dest, r.port, r.name, r.reason) for r in slot.audit_records()}


def test_releasing_the_slot_ends_a_checked_connection_the_server_keeps_open(net, slot, guest) -> None:
    keepalive_server(net)
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")

    def hold() -> socket.socket:
        sock = socket.create_connection((ALLOWED_HOST, PORT), timeout=3)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: web.test\r\n\r\n")
        assert sock.recv(100) == OK
        return sock

    sock = in_ns(guest, hold)
    with sock:
        assert slot.proxy is not None and len(slot.proxy.connections) == 1
        net.pool.release(slot)
        assert slot.proxy.connections == set()
        assert ended(sock, 3.0)


class BrokenFramer(nameproxy.HttpRequests):
    """A framer with a bug the guest can reach: a request for /boom raises something else than OSError."""

    def feed(self, data: bytes) -> list[nameproxy.Piece]:
        if b"/boom" in data:
            raise RuntimeError("a bug in the framer")
        return super().feed(data)


def test_an_unexpected_error_following_a_connection_refuses_and_records_it(net, slot, guest, monkeypatch) -> None:
    heads = keepalive_server(net)
    monkeypatch.setattr(nameproxy, "HttpRequests", BrokenFramer)
    slot.apply_policy(policy(WEB))
    lookup(guest, "web.test")
    proxy = slot.proxy
    assert proxy is not None

    def run() -> tuple[bytes, bool, bool]:
        with socket.create_connection((ALLOWED_HOST, PORT), timeout=3) as sock:  # in the first flight
            sock.sendall(b"GET /boom HTTP/1.1\r\nHost: web.test\r\n\r\n")
            at_once = ended(sock, 3.0)
        with socket.create_connection((ALLOWED_HOST, PORT), timeout=3) as sock:  # a later request, relay running
            sock.sendall(b"GET /a HTTP/1.1\r\nHost: web.test\r\n\r\n")
            first = sock.recv(100)
            sock.sendall(b"GET /boom HTTP/1.1\r\nHost: web.test\r\n\r\n")
            return first, at_once, ended(sock, 3.0)

    first, at_once, later = in_ns(guest, run)
    assert first == OK and at_once and later
    assert heads == [b"GET /a HTTP/1.1\r\nHost: web.test"]
    records = [r for r in slot.audit_records() if (r.dest, r.port, r.name, r.reason) == (ALLOWED_HOST, PORT, None, UNNAMED)]
    assert records and records[0].count == 2, slot.audit_records()
    deadline = time.monotonic() + 5
    while proxy.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not proxy.connections  # both ended, their threads gone
