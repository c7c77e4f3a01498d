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
import select
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from policy.model import form_doubt, path_ambiguity, request_doubt
from policy.suggest import (
    BLOCK_LISTED,
    NAME_REFUSED,
    POLICY,
    REQUEST_REFUSED,
    SECRET_REFUSED,
    UNNAMED,
    UPSTREAM_UNTRUSTED,
    AuditRecord,
    path_prefix,
)
from runner.net import addresses, netns
from runner.net.jobca import JobCA
from runner.net.loop import NetLoop
from runner.net.namecheck import (
    BAD_HTTP,
    HOST_MISMATCH,
    MAX_HELLO_BYTES,
    NOT_TLS_OR_HTTP,
    Claim,
    HttpRequests,
    Piece,
    client_hello,
    first_kind,
)
from runner.net.secretswap import Misuse, ResponseMask, ResponseRefused, SecretSwap, StreamScan

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
FIRST_FLIGHT_SECONDS = 10.0
CONNECT_SECONDS = 10.0
AUDIT_GRACE_SECONDS = 1.0  # audit mode: how long a guest may be silent before the server is let speak first
MAX_RECORDS = 1024
READ_BYTES = 16 * 1024
REFUSED_DRAIN_SECONDS = 10.0  # after a refused pipelined request: the earlier ones' responses, this long at most
PIPE_BYTES = 128 * 1024  # measured (bench/net.py): 1 MiB pipes moved less per second than 64-256 KiB
TIMED_OUT = "no TLS ClientHello or HTTP request head within the time allowed"
TOO_MANY = "too many connections open through the name check"
_SO_ORIGINAL_DST = 80
_SO_MARK = 36
_F_SETPIPE_SZ = 1031
Move = Callable[[socket.socket, socket.socket], None]  # one direction of a relay: src to dst until src ends
# A refused request, and the 403's text when the guest is told why (None: the connection is reset).
Refusal = tuple[Claim, str | None]
RecordKey = tuple[str, int, str | None, str, str | None, str | None, bool, str | None]


class NameGate(Protocol):
    """What the proxy asks of the slot's resolver (`runner.net.dns.SlotResolver`)."""

    def name_allowed(self, name: str, address: str, port: int) -> bool: ...

    def name_blocked(self, name: str) -> bool: ...

    def request_allowed(self, name: str, port: int, method: str, path: str, *, body: bool,
                        overrides: tuple[str, ...], form: bool) -> bool: ...

    def intercepts(self, name: str, port: int) -> bool: ...

    def audit_only(self) -> bool: ...

    def covers(self, name: str | None, port: int) -> bool: ...

    def handed_out_for(self, name: str, address: str) -> bool: ...

    def dialled_name(self, address: str) -> str | None: ...


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
class _Exchange:
    """One intercepted connection's destination and what the job's bound secrets need of it."""

    name: str
    address: str
    port: int
    secrets: SecretSwap | None
    mask: ResponseMask | None  # a bound host's responses: masked for reflected values
    scan: StreamScan = field(init=False)

    def __post_init__(self) -> None:
        self.scan = StreamScan(self.secrets or SecretSwap(()))


@dataclass(eq=False)
class NameProxy:
    """One slot's name check: its listener, its live connections and what it refused."""

    netns: str
    gate: NameGate
    # How the host verifies upstream servers when it terminates TLS (the host's trust store, plus
    # the operator's `network.upstream_ca`); the job's CA (`JobCA`) while its policy needs one.
    upstream_tls: ssl.SSLContext = field(default_factory=ssl.create_default_context)
    ca: JobCA | None = None
    # The job's bound secrets (runner.net.secretswap), while it has any: swapped into the requests
    # their bindings admit, refused everywhere else, masked in what bound hosts send back.
    secrets: SecretSwap | None = None
    refused: Counter[RecordKey] = field(default_factory=Counter)
    used: Counter[str] = field(default_factory=Counter)  # requests each binding's secret was swapped into
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
            self.used.clear()

    def records(self) -> list[AuditRecord]:
        with self.lock:
            items = sorted(self.refused.items(), key=lambda item: tuple(str(part) for part in item[0]))
        return [AuditRecord(address, port, "tcp", name, count, reason, method, path, unnamed, binding)
                for (address, port, name, reason, method, path, unnamed, binding), count in items]

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
        except Exception:  # a bug following the guest's bytes: refuse the connection, and record it
            self._failed(connection)
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

    def _failed(self, connection: _Connection) -> None:
        """What `_serve` does when following a connection raised something else than OSError: the
        guest's bytes took the check somewhere it does not go, so the connection is refused (reset)
        and recorded as malformed HTTP; the log gets the traceback."""
        log.exception("name check in %s failed on a connection; refused as malformed", self.netns)
        try:
            address, port = original_destination(connection.guest)
        except OSError:
            address, port = addresses.GATEWAY_IP, addresses.NAMECHECK_PORT
        self._note(address, port, Claim("http", None, f"{BAD_HTTP} (the check failed to follow it)"), UNNAMED)
        upstream = connection.upstream
        if upstream is not None:  # wakes a relay thread still reading it
            try:
                upstream.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _check(self, connection: _Connection) -> None:
        guest = connection.guest
        address, port = original_destination(guest)
        if self.gate.audit_only() and self._server_first(connection, address, port):
            return
        flight = self._first_flight(guest)
        if flight is None:
            return  # closed before it said anything: nothing reached anyone
        data, pieces, http = flight
        claim = pieces[0].claim if pieces else client_hello(data) if first_kind(data) == "tls" else None
        if claim is None:
            claim = Claim(first_kind(data) or "tcp", None, NOT_TLS_OR_HTTP if data and not first_kind(data) else TIMED_OUT)
        if http is None and self._secret_in_hello(data, claim, address, port):
            return
        if not self._admit(claim, address, port):
            if http is not None and self._why(claim, address, port) == REQUEST_REFUSED:
                _answer(guest, 403, _refused_text(claim))  # the name was fine: say what was not
            return
        if http is None and claim.name is not None and claim.refusal is None and self._intercepts(claim.name, port):
            self._intercept(connection, claim.name, address, port)
            return
        upstream = self._connect(connection, address, port)
        if upstream is None:
            return
        if http is None or not pieces:  # TLS (still unread in the socket), or audit mode letting HTTP through
            if http is not None:
                upstream.sendall(data)
            self._relay(connection, _splice, guest, upstream)
            return
        scan = StreamScan(self.secrets) if self.secrets is not None else None
        if not self._send_pieces(pieces, upstream, address, port, guest, scan):
            upstream.shutdown(socket.SHUT_WR)
            _splice(upstream, guest)
            connection.closed = True
            return
        self._relay(connection, lambda src, dst: self._follow_http(http, src, dst, address, port, scan), guest, upstream)

    def _server_first(self, connection: _Connection, address: str, port: int) -> bool:
        """Audit mode: a guest silent for `AUDIT_GRACE_SECONDS` may be waiting for a server-first
        protocol (ssh, smtp, a banner), which block mode refuses for naming nothing but audit mode
        must not stall for the whole first-flight deadline: connect upstream then, and when the
        server speaks before the guest, record the connection as unnamed, relay it as it is and
        return True. Otherwise (the guest spoke, in the grace time or after the connect) the first
        flight is read as in block mode. A client slower than the grace to a server that greets
        on connect is recorded as unnamed too (its suggestion, `raw: true`, still lets it pass);
        only such a connection reaches its address (a handshake, no byte) before its name is seen."""
        if select.select([connection.guest], [], [], AUDIT_GRACE_SECONDS)[0]:
            return False
        upstream = self._connect(connection, address, port)
        if upstream is None:
            return True
        ready = select.select([connection.guest, upstream], [], [], FIRST_FLIGHT_SECONDS - AUDIT_GRACE_SECONDS)[0]
        if upstream not in ready or connection.guest in ready:
            return False
        self._note(address, port, Claim("tcp", None, "the server spoke first"), self._why(
            Claim("tcp", None, "the server spoke first"), address, port) or UNNAMED)
        self._relay(connection, _splice, connection.guest, upstream)
        return True

    def _first_flight(self, guest: socket.socket) -> tuple[bytes, list[Piece], HttpRequests | None] | None:
        """The first flight: None if the guest closed before sending anything; else its bytes, the
        HTTP pieces framed from them (the first carries the claim) and the HTTP framer. A TLS (or
        unknown) first flight is only peeked at, so it is still in the socket for the splice or
        for the host's own TLS server; HTTP is read, since it is passed on piece by piece."""
        deadline = time.monotonic() + FIRST_FLIGHT_SECONDS
        data = _peek(guest, deadline)
        if data is None:
            return None
        if first_kind(data) != "http":
            return data, [], None
        http = HttpRequests()
        data, pieces = b"", list[Piece]()
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
                return (data, pieces, http) if data else None
            data += chunk
            pieces += http.feed(chunk)
            if any(piece.claim is not None for piece in pieces):
                return data, pieces, http

    def _admit(self, claim: Claim, address: str, port: int) -> bool:
        """Whether the claim may go on to `address`:`port` (audit mode: yes but counted, unless block-listed)."""
        reason = self._why(claim, address, port)
        if reason is None:
            return True
        self._note(address, port, claim, reason)
        return reason != BLOCK_LISTED and self.gate.audit_only()

    def _why(self, claim: Claim, address: str, port: int) -> str | None:
        """The reason the claim is refused (a `policy.suggest` reason), or None when it is admitted."""
        if claim.name is not None and self.gate.name_blocked(claim.name):
            return BLOCK_LISTED
        if self.gate.audit_only() and not self.gate.covers(claim.name or self.gate.dialled_name(address), port):
            # an audit opening (no rule for it): block mode refuses it by policy, unless it claims a
            # name the resolver did not hand this address out for (no rule could admit that)
            if claim.refusal is None and claim.name is not None and not self.gate.handed_out_for(claim.name, address):
                return NAME_REFUSED
            return POLICY
        if claim.refusal is not None:
            return UNNAMED
        if claim.name is None or not self.gate.name_allowed(claim.name, address, port):
            return NAME_REFUSED
        if claim.method is not None and not self.gate.request_allowed(
                claim.name, port, claim.method, claim.path or "", body=claim.body, overrides=claim.overrides,
                form=claim.form):
            return REQUEST_REFUSED
        return None

    def _intercepts(self, name: str, port: int) -> bool:
        """Whether the host terminates HTTPS to `name`:`port`: a `methods:`/`paths:` rule, or a
        secret bound there (the swap and the response mask need the plaintext)."""
        return self.gate.intercepts(name, port) or (self.secrets is not None and self.secrets.bound(name, port))

    def _secret_in_hello(self, data: bytes, claim: Claim, address: str, port: int) -> bool:
        """A placeholder in a TLS first flight (the server name, or anything else of the hello):
        refused in every mode, before a byte goes on."""
        misuse = self.secrets.misused(data) if self.secrets is not None else None
        if misuse is None and self.secrets is not None and claim.name is not None:
            misuse = self.secrets.in_name(claim.name)
        if misuse is None:
            return False
        self._note_secret(address, port, Claim(claim.kind, None, "a placeholder in the TLS ClientHello"), misuse)
        return True

    def _note_secret(self, address: str, port: int, claim: Claim, misuse: Misuse) -> str:
        """Record a placeholder where its binding does not let it go; the 403's text."""
        self._note(address, port, claim, SECRET_REFUSED, binding=misuse.binding)
        where = f" ({misuse.why})" if misuse.why else ""
        return (f"microvm-check: this request carries the placeholder of secret {misuse.binding} where its binding "
                f"does not let it go{where}; the job's egress record lists it\n")

    def _intercept(self, connection: _Connection, name: str, address: str, port: int) -> None:
        """HTTPS under a `methods:`/`paths:` rule: the host's TLS server for the guest (a leaf of the
        job's CA), its own verified TLS client upstream, and every request checked in between."""
        ca, guest = self.ca, connection.guest
        if ca is None:  # the slot's policy changed under this connection: nothing to present
            return
        guest.settimeout(FIRST_FLIGHT_SECONDS)
        tls_guest = ca.server_context(name).wrap_socket(guest, server_side=True, do_handshake_on_connect=False)
        connection.guest = tls_guest  # the plain socket object is detached now: its descriptor is this one's
        try:
            tls_guest.do_handshake()  # reads the ClientHello the first flight only peeked at
        except (ssl.SSLError, OSError) as exc:
            self._note(address, port, Claim("tls", name, f"the guest refused the job CA's certificate: {exc}"), UNNAMED)
            return
        upstream = self._connect(connection, address, port)
        if upstream is None:
            return
        upstream.settimeout(CONNECT_SECONDS)
        try:
            tls_up = self.upstream_tls.wrap_socket(upstream, server_hostname=name)
        except ssl.SSLCertVerificationError as exc:
            why = f"the certificate of {name} failed verification on the host: {exc.verify_message}"
            self._note(address, port, Claim("tls", name, why), UPSTREAM_UNTRUSTED)
            _answer(tls_guest, 502, f"microvm-check: {why}\n")
            connection.closed = True
            return
        except (ssl.SSLError, OSError) as exc:
            _answer(tls_guest, 502, f"microvm-check: TLS to {name} failed on the host: {exc}\n")
            connection.closed = True
            return
        connection.upstream = tls_up
        tls_guest.settimeout(None)
        tls_up.settimeout(None)
        secrets = self.secrets
        mask = ResponseMask.of(secrets) if secrets is not None and secrets.bound_host(name) else None
        self._relay_tls(connection, tls_guest, tls_up, _Exchange(name, address, port, secrets, mask))

    def _relay_tls(self, connection: _Connection, guest: ssl.SSLSocket, upstream: ssl.SSLSocket,
                   exchange: _Exchange) -> None:
        """Both directions of an intercepted connection in this one thread (an SSL object must not be
        read and written from two threads at once): requests framed and checked (a bound secret
        swapped in), responses copied (a bound host's masked, `runner.net.secretswap`)."""
        http = HttpRequests()
        refused: Refusal | None = None  # a later request refused: its earlier ones' responses still go out
        drain_until, forwarded = 0.0, 0
        for sock in (guest, upstream):
            sock.setblocking(False)  # OpenSSL may hold a record already read: every recv is tried, select only then
        while not connection.closed:
            progressed = False
            for src in ((upstream,) if refused is not None else (guest, upstream)):
                try:
                    data = src.recv(READ_BYTES)
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                    continue
                progressed = True
                if src is upstream and not self._pass_response(connection, guest, exchange, data):
                    return None
                if not data:  # either end done: so is the connection (what came before is all sent)
                    return self._end_refused(connection, guest, refused)
                if src is upstream:
                    continue
                refused, sent = self._forward_requests(http, data, upstream, exchange)
                forwarded += sent
                if refused is not None and not forwarded:
                    return self._end_refused(connection, guest, refused)  # nothing to wait for
                if refused is not None:
                    drain_until = time.monotonic() + REFUSED_DRAIN_SECONDS
            if progressed:
                continue
            wait = None if refused is None else drain_until - time.monotonic()
            if wait is not None and (wait <= 0 or not select.select([upstream], [], [], min(wait, 1.0))[0]):
                return self._end_refused(connection, guest, refused)  # upstream idle: all answered
            if wait is None:
                select.select([guest, upstream], [], [])
        return None

    def _pass_response(self, connection: _Connection, guest: ssl.SSLSocket, exchange: _Exchange, data: bytes) -> bool:
        """Upstream's bytes to the guest (masked from a bound host; b"": its end); False when a bound
        host's response cannot be read for reflected secrets (the guest gets a 502 saying why)."""
        if exchange.mask is None:
            _send_all(guest, data)
            return True
        try:
            out = exchange.mask.feed(data) if data else exchange.mask.end()
        except ResponseRefused as exc:
            connection.closed = True
            guest.setblocking(True)
            _answer(guest, 502, f"microvm-check: {exchange.name} sent {exc}; a secret is bound there, so the "
                                "host passes on only responses it can read\n")
            return False
        if out:
            _send_all(guest, out)
        return True

    def _forward_requests(self, http: HttpRequests, data: bytes, upstream: ssl.SSLSocket,
                          exchange: _Exchange) -> tuple[Refusal | None, int]:
        """Frame the guest's decrypted bytes and pass on what is admitted (with a bound secret
        swapped in): the first refusal and how many request heads went upstream."""
        sent, name, address, port = 0, exchange.name, exchange.address, exchange.port
        if http.state == "closed":  # audit mode let a refused request through: no framing to follow
            pieces = [] if http.closed_after else [Piece(data, body=True)]
        else:
            pieces = http.feed(data)
        for piece in pieces:
            claim = piece.claim
            if claim is not None and claim.name != name and claim.refusal is None:
                claim = Claim("http", claim.name, HOST_MISMATCH, claim.method, claim.path)
            if piece.after_close:  # after a request with a body: recorded if refused, never passed on
                if claim is not None:
                    self._admit(claim, address, port)
                continue
            if claim is not None and not self._admit(claim, address, port):
                return (claim, _refused_text(claim) if self._why(claim, address, port) == REQUEST_REFUSED else None), sent
            outgoing = self._swapped(exchange, piece, claim)
            if isinstance(outgoing, tuple):
                return outgoing, sent
            if outgoing:
                _send_all(upstream, outgoing)
            sent += claim is not None
        return None, sent

    def _swapped(self, exchange: _Exchange, piece: Piece, claim: Claim | None) -> bytes | Refusal:
        """A piece as it goes upstream under the job's bound secrets: a head with the bound header's
        real value where a binding admits it (and asking for identity encoding from a bound host),
        a body unchanged; or the refusal when a placeholder is where its binding does not let it go."""
        secrets = exchange.secrets
        if secrets is None:
            return piece.data
        if claim is None or claim.method is None:  # body bytes as one stream; chunk framing on its own
            misuse = exchange.scan.feed(piece.data) if piece.body else secrets.misused(piece.data)
            return piece.data if misuse is None else self._secret_refusal(exchange, Claim("http", exchange.name), misuse)
        exchange.scan.reset()
        swapped = secrets.swap_head(exchange.name, exchange.port, claim.method, claim.path or "", piece.data,
                                    body=claim.body, overrides=claim.overrides, form=claim.form)
        if isinstance(swapped, Misuse):
            return self._secret_refusal(exchange, claim, swapped)
        head, used = swapped
        if used is not None:
            self._count_use(used)
        if exchange.mask is not None:
            exchange.mask.expect(claim.method)
        return head

    def _secret_refusal(self, exchange: _Exchange, claim: Claim, misuse: Misuse) -> Refusal:
        return claim, self._note_secret(exchange.address, exchange.port, claim, misuse)

    def _count_use(self, binding: str) -> None:
        with self.lock:
            self.used[binding] += 1

    def _end_refused(self, connection: _Connection, guest: ssl.SSLSocket, refused: Refusal | None) -> None:
        """The end of an intercepted connection: a refused request is answered (403, why) last."""
        connection.closed = True
        if refused is not None and refused[1] is not None:
            guest.setblocking(True)
            _answer(guest, 403, refused[1])

    def _connect(self, connection: _Connection, address: str, port: int) -> socket.socket | None:
        if connection.upstream is not None:  # audit mode connected before the first flight
            return connection.upstream
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

    def _send_pieces(self, pieces: list[Piece], upstream: socket.socket, address: str, port: int,
                     guest: socket.socket, scan: StreamScan | None) -> bool:
        """Pass on framed HTTP pieces up to the first refused request; False when one was refused
        (a request refused for its method or path, or for a secret's placeholder, is answered 403
        with the reason). Plain HTTP never carries a bound secret: a placeholder in it is refused."""
        for index, piece in enumerate(pieces):
            if piece.after_close:  # after a request with a body: recorded if refused, never passed on
                if piece.claim is not None:
                    self._admit(piece.claim, address, port)
                continue
            if piece.claim is not None and index and not self._admit(piece.claim, address, port):
                if self._why(piece.claim, address, port) == REQUEST_REFUSED:
                    _answer(guest, 403, _refused_text(piece.claim))
                return False
            misuse = self._plain_misuse(piece, scan)
            if misuse is not None:
                _answer(guest, 403, self._note_secret(address, port, piece.claim or Claim("http", None), misuse))
                return False
            if piece.data:
                upstream.sendall(piece.data)
        return True

    @staticmethod
    def _plain_misuse(piece: Piece, scan: StreamScan | None) -> Misuse | None:
        if scan is None or not piece.data:
            return None
        if piece.claim is not None:
            scan.reset()
            return scan.swap.misused(piece.data)
        return scan.feed(piece.data) if piece.body else scan.swap.misused(piece.data)

    def _follow_http(self, http: HttpRequests, guest: socket.socket, upstream: socket.socket,
                     address: str, port: int, scan: StreamScan | None) -> None:
        """Guest to upstream of an HTTP connection: every later request is checked like the first."""
        while True:
            chunk = guest.recv(READ_BYTES)
            if not chunk:
                break
            if http.state == "closed":  # audit mode let a refused request through: no framing to follow
                if not http.closed_after:  # (after a request with a body nothing more goes upstream)
                    upstream.sendall(chunk)
                continue
            pieces = http.feed(chunk)
            if not self._send_pieces([Piece(b"")] + pieces, upstream, address, port, guest, scan):
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

    def _note(self, address: str, port: int, claim: Claim, reason: str, binding: str | None = None) -> None:
        unnamed = claim.refusal is not None and reason in (UNNAMED, POLICY)
        # audit mode, no rule: the name the guest dialled, which a suggested raw: true entry needs
        # (an ECH hello's outer name is not it); else the name claimed, if any
        name = self.gate.dialled_name(address) if unnamed and reason == POLICY else claim.name
        key: RecordKey = (address, port, name, reason, claim.method, path_prefix(claim.path) if claim.path else None,
                          unnamed, binding)
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


def _peek(sock: socket.socket, deadline: float) -> bytes | None:
    """The first flight without reading it (MSG_PEEK): as soon as it is a complete ClientHello, or
    plainly not one; None when the guest closed before sending a byte. Waiting for more bytes backs
    off (1 ms doubling to 64 ms), so a guest trickling bytes costs little host CPU."""
    data, pause = b"", 0.001
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([sock], [], [], remaining)[0]:
            return data
        peeked = sock.recv(MAX_HELLO_BYTES + 5 + 16, socket.MSG_PEEK)
        if not peeked:
            return data or None
        if len(peeked) == len(data):  # readable only for what was already seen
            time.sleep(min(pause, max(remaining, 0.0)))
            pause = min(pause * 2, 0.064)
            continue
        data = peeked
        if first_kind(data) != "tls" or client_hello(data) is not None:
            return data


def _refused_text(claim: Claim) -> str:
    """The 403's body: the request, and what about it no `methods:`/`paths:` rule admits, if that was it."""
    doubt = request_doubt(claim.method or "", body=claim.body, overrides=claim.overrides)
    ambiguity = path_ambiguity(claim.path or "")
    form = form_doubt(("POST",), body=claim.body, form=claim.form)  # what a rule short of any method refuses
    return (f"microvm-check: {claim.method} {claim.path} on {claim.name} is not allowed by this job's egress "
            "policy (its methods:/paths: for that host)" + (f"; no such rule admits {doubt}" if doubt else "")
            + (f"; no paths: glob admits this path: {ambiguity}" if ambiguity else "")
            + (f"; no such rule admits {form}" if form else "") + "\n")


def _answer(sock: socket.socket, status: int, text: str) -> None:
    """A short HTTP response saying why, then the end of the connection (best effort)."""
    reason = {403: "Forbidden", 502: "Bad Gateway"}.get(status, "Error")
    body = text.encode("utf-8", "replace")
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        sock.settimeout(2.0)
        sock.sendall(head + body)
        if isinstance(sock, ssl.SSLSocket):
            sock.unwrap()
    except (OSError, ValueError):
        pass


def _send_all(sock: ssl.SSLSocket, data: bytes) -> None:
    """sendall for a non-blocking TLS socket: waits for it to take more (CPython lets OpenSSL
    retry a write from a moved buffer)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except (ssl.SSLWantWriteError, BlockingIOError):
            select.select([], [sock], [])
        except ssl.SSLWantReadError:
            select.select([sock], [], [])


def _half_close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
