"""The host-side name check every TCP connection under a `host:` rule goes through.

The slot's nat table redirects such connections (`runner.net.slots`, chain `NAMECHECK_CHAIN`) to
this listener on the gateway inside the slot's namespace. Before a byte reaches the destination it
reads the first flight (`runner.net.namecheck`): the TLS ClientHello's SNI or the HTTP request's
Host must be a name the policy allows on that port, and the original destination (SO_ORIGINAL_DST)
an address the resolver handed out for that very name to this VM, while that opening is live
(`SlotResolver.name_allowed`). Why both: a CDN serves thousands of names at one address and routes
by the name, so an address alone admits every site on it; a name alone would let the guest send
`Host: pypi.org` to any address.

An admitted TLS connection is then spliced both ways (`os.splice`, kernel to kernel, no copy
through Python); an HTTP one is spliced from upstream to guest, while the guest's bytes are framed
request by request so that each later request on a kept-alive or pipelined connection is checked
before it is passed on. What is refused is reset (the client fails at once) and counted for the
job's record with the name it claimed; in audit mode it is counted and let through.

Bounds (the guest is hostile): `MAX_CONNECTIONS` per slot at once (each holds two threads),
`FIRST_FLIGHT_SECONDS` to name itself, `CONNECT_SECONDS` for the upstream, the parser's size caps,
`MAX_RECORDS` distinct refusals remembered. Upstream sockets carry `addresses.NAMECHECK_MARK`: the
slot's guard lets nothing else out of the namespace.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from policy.suggest import BLOCK_LISTED, NAME_REFUSED, UNNAMED, AuditRecord
from runner.net import addresses, netns
from runner.net.loop import NetLoop
from runner.net.namecheck import NOT_TLS_OR_HTTP, Claim, HttpRequests, Piece, client_hello, first_kind

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
FIRST_FLIGHT_SECONDS = 10.0
CONNECT_SECONDS = 10.0
MAX_RECORDS = 1024
READ_BYTES = 16 * 1024
PIPE_BYTES = 128 * 1024  # measured (bench/net.py): 1 MiB pipes moved less per second than 64-256 KiB
TIMED_OUT = "no TLS ClientHello or HTTP request head within the time allowed"
TOO_MANY = "too many connections open through the name check"
_SO_ORIGINAL_DST = 80
_SO_MARK = 36
_F_SETPIPE_SZ = 1031
Move = Callable[[socket.socket, socket.socket], None]  # one direction of a relay: src to dst until src ends


class NameGate(Protocol):
    """What the proxy asks of the slot's resolver (`runner.net.dns.SlotResolver`)."""

    def name_allowed(self, name: str, address: str, port: int) -> bool: ...

    def name_blocked(self, name: str) -> bool: ...

    def audit_only(self) -> bool: ...


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where the guest's redirected connection was going (the nat table's conntrack entry)."""
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset: a refused client fails at once instead of waiting for a reply."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


@dataclass(eq=False)
class _Connection:
    guest: socket.socket
    upstream: socket.socket | None = None
    closed: bool = False

    def shut(self) -> None:
        """Wake whatever thread is blocked on either socket (close happens in that thread)."""
        self.closed = True
        for sock in (self.guest, self.upstream):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@dataclass(eq=False)
class NameProxy:
    """One slot's name check: its listener, its live connections and what it refused."""

    netns: str
    gate: NameGate
    refused: Counter[tuple[str, int, str | None, str]] = field(default_factory=Counter)
    listener: socket.socket | None = None
    connections: set[_Connection] = field(default_factory=set)
    threads: set[threading.Thread] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, loop: NetLoop) -> None:
        sock = netns.socket_in(self.netns, socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_IP, 15, 1)  # IP_FREEBIND: the gateway address may come later
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addresses.GATEWAY_IP, addresses.NAMECHECK_PORT))
            sock.listen(MAX_CONNECTIONS)
        except BaseException:
            sock.close()
            raise
        self.listener = sock
        loop.add_reader(sock, self._on_accept)

    def stop(self, loop: NetLoop) -> None:
        if self.listener is not None:
            loop.remove_reader(self.listener)
            self.listener = None
        self.clear()

    def clear(self, wait: float = 5.0) -> None:
        """End every connection (the previous job's must not outlive it) and forget the refusals."""
        with self.lock:
            connections, threads = list(self.connections), list(self.threads)
        for connection in connections:
            connection.shut()
        deadline = time.monotonic() + wait
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        with self.lock:
            self.refused.clear()

    def records(self) -> list[AuditRecord]:
        with self.lock:
            items = sorted(self.refused.items(), key=lambda item: (item[0][0], item[0][1], item[0][2] or "", item[0][3]))
        return [AuditRecord(address, port, "tcp", name, count, reason) for (address, port, name, reason), count in items]

    def _on_accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        connection = _Connection(sock)
        with self.lock:
            full = len(self.connections) >= MAX_CONNECTIONS
            if not full:
                self.connections.add(connection)
                thread = threading.Thread(target=self._serve, args=(connection,), name="mvc-namecheck", daemon=True)
                self.threads.add(thread)
        if full:
            try:
                address, port = original_destination(sock)
            except OSError:
                address, port = addresses.GATEWAY_IP, addresses.NAMECHECK_PORT
            self._note(address, port, Claim("tcp", None, TOO_MANY), UNNAMED)
            reset(sock)
            return
        thread.start()

    def _serve(self, connection: _Connection) -> None:
        try:
            netns.enter(self.netns)  # this thread's own sockets (the upstream one) live in the slot
            self._check(connection)
        except OSError as exc:
            log.debug("name-checked connection in %s ended: %s", self.netns, exc)
        finally:
            if connection.upstream is not None:
                connection.upstream.close()
            if connection.closed:
                connection.guest.close()
            else:
                reset(connection.guest)
            with self.lock:
                self.connections.discard(connection)
                self.threads.discard(threading.current_thread())

    def _check(self, connection: _Connection) -> None:
        guest = connection.guest
        address, port = original_destination(guest)
        data, pieces, http = self._first_flight(guest)
        if data is None:
            return  # closed before it said anything: nothing reached anyone
        claim = pieces[0].claim if pieces else client_hello(data) if first_kind(data) == "tls" else None
        if claim is None:
            claim = Claim(first_kind(data) or "tcp", None, NOT_TLS_OR_HTTP if data and not first_kind(data) else TIMED_OUT)
        if not self._admit(claim, address, port):
            return
        upstream = self._connect(connection, address, port)
        if upstream is None:
            return
        if http is None or not pieces:  # TLS, or audit mode letting an unframed first flight through
            upstream.sendall(data)
            self._relay(connection, _splice, guest, upstream)
            return
        if not self._send_pieces(pieces, upstream, address, port):
            upstream.shutdown(socket.SHUT_WR)
            _splice(upstream, guest)
            connection.closed = True
            return
        self._relay(connection, lambda src, dst: self._follow_http(http, src, dst, address, port), guest, upstream)

    def _first_flight(self, guest: socket.socket) -> tuple[bytes | None, list[Piece], HttpRequests | None]:
        """The first flight's bytes (None if the guest closed first), the HTTP pieces framed from
        them (the first carries the claim) and the HTTP framer, or no pieces for TLS and the rest."""
        deadline = time.monotonic() + FIRST_FLIGHT_SECONDS
        data = b""
        http: HttpRequests | None = None
        pieces: list[Piece] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return data, pieces, http
            guest.settimeout(remaining)
            try:
                chunk = guest.recv(READ_BYTES)
            except TimeoutError:
                return data, pieces, http
            if not chunk:
                return (None, [], None) if not data else (data, pieces, http)
            data += chunk
            kind = first_kind(data)
            if kind == "http":
                http = http or HttpRequests()
                pieces += http.feed(chunk)
                if any(piece.claim is not None for piece in pieces):
                    return data, pieces, http
            elif kind != "tls" or client_hello(data) is not None:
                return data, pieces, http

    def _admit(self, claim: Claim, address: str, port: int) -> bool:
        """Whether the claim may go on to `address`:`port` (audit mode: always, but counted)."""
        if claim.name is not None and self.gate.name_blocked(claim.name):
            self._note(address, port, claim, BLOCK_LISTED)
            return False  # in every mode
        if claim.refusal is not None:
            reason = UNNAMED
        elif claim.name is None or not self.gate.name_allowed(claim.name, address, port):
            reason = NAME_REFUSED
        else:
            return True
        self._note(address, port, claim, reason)
        return self.gate.audit_only()

    def _connect(self, connection: _Connection, address: str, port: int) -> socket.socket | None:
        upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        upstream.setsockopt(socket.SOL_SOCKET, _SO_MARK, addresses.NAMECHECK_MARK)
        with self.lock:
            if connection.closed:
                upstream.close()
                return None
            connection.upstream = upstream
        upstream.settimeout(CONNECT_SECONDS)
        upstream.connect((address, port))
        upstream.settimeout(None)
        connection.guest.settimeout(None)
        return upstream

    def _send_pieces(self, pieces: list[Piece], upstream: socket.socket, address: str, port: int) -> bool:
        """Pass on framed HTTP pieces up to the first refused request; False when one was refused."""
        for index, piece in enumerate(pieces):
            if piece.claim is not None and index and not self._admit(piece.claim, address, port):
                return False
            if piece.data:
                upstream.sendall(piece.data)
        return True

    def _follow_http(self, http: HttpRequests, guest: socket.socket, upstream: socket.socket,
                     address: str, port: int) -> None:
        """Guest to upstream of an HTTP connection: every later request is checked like the first."""
        while True:
            chunk = guest.recv(READ_BYTES)
            if not chunk:
                break
            if http.state == "closed":  # audit mode let a refused request through: no framing to follow
                upstream.sendall(chunk)
                continue
            pieces = http.feed(chunk)
            if not self._send_pieces([Piece(b"")] + pieces, upstream, address, port):
                break
        upstream.shutdown(socket.SHUT_WR)

    def _relay(self, connection: _Connection, outbound: Move, guest: socket.socket, upstream: socket.socket) -> None:
        """Run guest->upstream (`outbound`) here and upstream->guest spliced in a second thread."""
        inbound = threading.Thread(target=_pump, args=(connection, _splice, upstream, guest),
                                   name="mvc-namecheck", daemon=True)
        with self.lock:
            self.threads.add(inbound)
        inbound.start()
        try:
            _pump(connection, outbound, guest, upstream)
            inbound.join()
        finally:
            with self.lock:
                self.threads.discard(inbound)
        connection.closed = True

    def _note(self, address: str, port: int, claim: Claim, reason: str) -> None:
        key = (address, port, claim.name, reason)
        with self.lock:
            first = key not in self.refused
            if first and len(self.refused) >= MAX_RECORDS:
                return
            self.refused[key] += 1
        if first:
            log.info("%s %s to %s:%d in %s (claimed %s): %s", "audited" if self.gate.audit_only() else "refused",
                     claim.kind, address, port, self.netns, claim.name or "no name", claim.refusal or "not allowed there")


def _pump(connection: _Connection, move: Move, src: socket.socket, dst: socket.socket) -> None:
    """One direction; an error ends both (the other thread is woken by the shutdown)."""
    try:
        move(src, dst)
    except OSError:
        connection.shut()


def _splice(src: socket.socket, dst: socket.socket) -> None:
    """Move `src`'s bytes to `dst` through a pipe, kernel to kernel, until `src` ends; then end `dst`'s side."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(write_end, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # a smaller pipe only costs more calls
        while True:
            moved = os.splice(src.fileno(), write_end, PIPE_BYTES, flags=os.SPLICE_F_MOVE)
            if moved == 0:
                break
            while moved:
                moved -= os.splice(read_end, dst.fileno(), moved, flags=os.SPLICE_F_MOVE)
    finally:
        os.close(read_end)
        os.close(write_end)
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
