"""A peer's buffered bodies count against its budget until their answers begin (issue 40, item 9).

The job API parses a JSON body on a worker, holding the interpreter lock: before, a peer's bodies left
its budget as soon as the loop had read them, so one uid's 64 bodies of 1 MiB were parsed at once and
stalled health (and the loop, and every other peer) for seconds. Now a peer's bodies in hand (being
read, waiting for a worker, handled) stay within its `max_body_bytes_per_peer`; the next waits its
turn unread, in order, and starts as soon as an earlier one's answer begins. Its bodies that keep up
never push each other out; other peers are served meanwhile.

A toy handler on loopback TCP (the attacker's peer is 127.0.0.2), as in test_httpserve_limits.py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

from runner.httpserve import BoundedHTTPServer, ServedRequest, ServerLimits, listen_tcp
from tests.test_httpserve_limits import ATTACKER, answer, connect, post_head

BODY = 1000


class Held(ServedRequest):
    """POST /NAME: reads the body, notes NAME as entered, begins its answer once OPEN[NAME] is set, and ends
    it once ENDING is set; POST / answers at once."""

    entered: set[str] = set()
    open: dict[str, threading.Event] = {}
    ending = threading.Event()

    def do_POST(self) -> None:
        size = sum(len(piece) for piece in self.body())
        name = self.path.strip("/")
        if not name:
            return self.respond(200, str(size).encode(), {"Content-Type": "text/plain"})
        self.entered.add(name)
        self.open[name].wait(30)
        self.start_response(200, {"Content-Type": "text/plain"})
        self.send_data(b"%d\n" % size)
        self.ending.wait(30)
        self.end_response()


@contextlib.contextmanager
def serving(limits: ServerLimits, names: str = "") -> Iterator[int]:
    Held.entered, Held.ending = set(), threading.Event()
    Held.open = {name: threading.Event() for name in names}
    server = BoundedHTTPServer(listen_tcp("127.0.0.1", 0), Held, limits, name="test-budget",
                               error_body=lambda message: message.encode())
    server.start()
    try:
        yield server.address[1]
    finally:
        Held.ending.set()
        for gate in Held.open.values():
            gate.set()
        server.close()


def post(name: str, length: int = BODY) -> bytes:
    return post_head(length).replace(b"POST / ", f"POST /{name} ".encode()) + b"x" * length


def streamed(sock: socket.socket) -> bytes:
    """A Held answer up to its last chunk (or what came of it before the socket's 5 s timeout)."""
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while not data.endswith(b"0\r\n\r\n") and (chunk := sock.recv(65536)):
            data += chunk
    return data


def until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_a_peers_bodies_past_its_budget_wait_until_an_earlier_answer_begins() -> None:
    limits = ServerLimits(buffer_body_max=1 << 20, max_body_bytes_per_peer=2 * BODY, wait_seconds=30.0)
    with serving(limits, "abc") as port, contextlib.ExitStack() as stack:
        a, b = (stack.enter_context(connect(port, ATTACKER, post(name))) for name in "ab")
        assert until(lambda: Held.entered == {"a", "b"}), Held.entered
        c = stack.enter_context(connect(port, ATTACKER, post("c")))
        time.sleep(0.5)
        assert Held.entered == {"a", "b"}  # c waits, unread: its peer has 2 bodies in hand
        with connect(port, "127.0.0.1", post_head(10) + b"0123456789") as other:
            assert (answer(other) or b"").startswith(b"HTTP/1.1 200")  # another peer is served meanwhile
        Held.open["a"].set()  # a's answer begins while its handler still runs: its body is done with
        assert until(lambda: "c" in Held.entered), "c never started after a's answer began"
        Held.open["b"].set()
        Held.open["c"].set()
        Held.ending.set()
        for sock in (a, b, c):
            reply = streamed(sock)
            assert reply.startswith(b"HTTP/1.1 200"), reply  # none was refused: c waited its turn


def test_a_body_that_waits_past_wait_seconds_is_told_to_come_back() -> None:
    limits = ServerLimits(buffer_body_max=1 << 20, max_body_bytes_per_peer=BODY, wait_seconds=1.0, retry_after_seconds=3)
    with serving(limits, "ab") as port, contextlib.ExitStack() as stack:
        stack.enter_context(connect(port, ATTACKER, post("a")))
        assert until(lambda: Held.entered == {"a"})
        late = stack.enter_context(connect(port, ATTACKER, post("b")))
        reply = answer(late, 10.0) or b""
        assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 3" in reply, reply
        assert Held.entered == {"a"}


def test_a_peers_waiting_bodies_start_in_the_order_they_came() -> None:
    """A small body that would fit does not overtake its peer's larger one waiting before it."""
    limits = ServerLimits(buffer_body_max=1 << 20, max_body_bytes_per_peer=BODY + BODY // 2, wait_seconds=30.0)
    with serving(limits, "abd") as port, contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connect(port, ATTACKER, post("a")))]
        assert until(lambda: Held.entered == {"a"})
        socks.append(stack.enter_context(connect(port, ATTACKER, post("b"))))  # waits for a's room
        time.sleep(0.2)
        socks.append(stack.enter_context(connect(port, ATTACKER, post("d", 10))))  # would fit now, but b came first
        time.sleep(0.5)
        assert Held.entered == {"a"}
        Held.open["a"].set()
        assert until(lambda: Held.entered == {"a", "b", "d"}), Held.entered  # b, then d beside it
        Held.open["b"].set()
        Held.open["d"].set()
        Held.ending.set()
        for sock in socks:
            reply = streamed(sock)
            assert reply.startswith(b"HTTP/1.1 200"), reply


def test_a_newcomer_waits_behind_its_peers_bodies_that_keep_up_instead_of_closing_them() -> None:
    """At its peer's cap of bodies being read (1 here), a newcomer does not close the body being read when that
    one keeps up (a young body is not judged yet); it starts as soon as that body has arrived whole, before
    that body's answer."""
    limits = ServerLimits(buffer_body_max=1 << 20, max_bodies_per_peer=1, body_seconds=10.0)
    with serving(limits, "ab") as port, contextlib.ExitStack() as stack:
        first = stack.enter_context(connect(port, ATTACKER, post("a")[:-BODY // 2]))
        time.sleep(0.2)
        newcomer = stack.enter_context(connect(port, ATTACKER, post("b", 10)))
        time.sleep(0.3)
        assert not Held.entered
        first.sendall(b"x" * (BODY // 2))
        assert until(lambda: Held.entered == {"a", "b"}), Held.entered  # a's answer has not begun
        Held.open["a"].set()
        Held.open["b"].set()
        Held.ending.set()
        for sock, size in ((first, BODY), (newcomer, 10)):
            reply = streamed(sock)
            assert reply.startswith(b"HTTP/1.1 200") and b"\r\n%d\n\r\n" % size in reply, reply


def test_a_waiting_body_takes_the_place_of_its_peers_body_once_that_one_lags() -> None:
    """A young body is not judged; once it has lagged behind body_min_rate for a second, the body waiting
    for its room closes it (503) rather than waiting out its grace (body_seconds)."""
    limits = ServerLimits(buffer_body_max=1 << 20, max_body_bytes_per_peer=BODY, body_seconds=10.0)
    with serving(limits) as port, contextlib.ExitStack() as stack:
        lagging = stack.enter_context(connect(port, ATTACKER, post_head(BODY) + b"x" * 10))
        waiting = stack.enter_context(connect(port, ATTACKER, post_head(BODY) + b"y" * BODY))
        assert answer(lagging, 0.5) is None  # young: not closed for the newcomer
        reply = answer(lagging, 5.0) or b""
        assert reply.startswith(b"HTTP/1.1 503") and b"arrived too slowly" in reply, reply
        reply = answer(waiting, 5.0) or b""
        assert reply.startswith(b"HTTP/1.1 200"), reply
