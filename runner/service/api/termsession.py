"""A terminal session on an upgraded connection, for both APIs that offer one: the job API's `jobs attach`
(attach.py, the operator's) and the sandbox API's `terminal()` (sandboxroutes.py, the SDK's). The stream
is the contract's (microvm_check/contract.py, runner/jobapi/termwire.py): the client's frames in, read on
the request's worker; the terminal's output out, from a thread of its own; the EXIT frame last.

What differs is the subclass's: what the client is shown of the output (`shown`: attach filters it for
an operator's terminal, a sandbox's caller gets the raw bytes), what is recorded of what is typed and
shown, and what is said when the session ends (`note`, `ended`). The guest is hostile: a frame is held
to its kind and size before it is read, a resize to the guest's bounds, a signal to the names it knows,
and a client that takes no output for SEND_SECONDS is cut off (the VM's channel must flow).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from typing import TYPE_CHECKING

from runner.jobapi import termwire
from runner.sandbox.terminal import Terminal
from runner.service.api.refusals import BadRequest
from runner.vm.guestwire import PTY_MAX_SIDE, PTY_SIGNALS

if TYPE_CHECKING:
    from runner.service.api.exchange import Exchange

log = logging.getLogger(__name__)

SEND_SECONDS = 10.0  # a client that takes no output for this long is detached (the VM's channel must flow)


class TerminalSession:
    """One client of one terminal, after the 101. `serve` is its whole life, on the request's worker."""

    def __init__(self, sock: socket.socket, buffered: bytes, terminal: Terminal, name: str) -> None:
        self.sock, self.terminal, self.name = sock, terminal, name
        self.frames = termwire.FrameReader(sock.recv, termwire.CLIENT_KINDS, buffered)
        self._send_lock = threading.Lock()

    # -- what a kind of session decides -----------------------------------------------------------------

    def typed(self, data: bytes) -> None:
        """Input the client typed, before the terminal gets it."""

    def shown(self, chunk: bytes) -> bytes:
        """What the client is sent of a chunk of the terminal's output (raising ends the session with it)."""
        return chunk

    def note(self, text: str) -> None:
        """Something the session's owner should hear of (a client that broke off, a failed resize)."""
        log.info("terminal session %s: %s", self.name, text)

    def ended(self, outcome: dict[str, object]) -> None:
        """The session ended with `outcome` (the EXIT frame's, sent after this)."""
        self.note(f"ended: {json.dumps(outcome)}")

    # -- the session ------------------------------------------------------------------------------------

    def serve(self) -> None:
        # one timeout for both threads, set before either runs: settimeout switches the socket's blocking mode,
        # and a switch under the other thread's recv or send made it fail with EAGAIN (a session cut off)
        self.sock.settimeout(SEND_SECONDS)
        pump = threading.Thread(target=self._pump, name=f"terminal-{self.name}", daemon=True)
        pump.start()
        try:
            self._take_input()
        finally:
            try:
                self.terminal.end()  # detached (or the client broke off): its program ends, the VM runs on
            except Exception as exc:
                log.debug("ending terminal session %s: %s", self.name, exc)
            pump.join()

    def _take_input(self) -> None:
        while True:
            try:
                frame = self.frames.next()
            except TimeoutError:  # nothing typed for a while (the frame read so far is kept): read on
                if self.terminal.outcome is not None:
                    return
                continue
            except (termwire.FrameError, OSError) as exc:
                self.note(f"its client broke off ({exc})")
                return
            if frame is None or self.terminal.outcome is not None:
                return  # detached (the client closed), or the program ended
            try:
                self._act(frame)
            except Exception as exc:  # the VM went, a bad resize: the session ends, the VM is not ours to end
                self.note(str(exc))
                return

    def _act(self, frame: termwire.Frame) -> None:
        if frame.kind == termwire.INPUT:
            self.typed(frame.payload)
            self.terminal.write(frame.payload)
        elif frame.kind == termwire.RESIZE:
            self.terminal.resize(*termwire.parse_size(frame.payload, PTY_MAX_SIDE))
        elif frame.payload.decode(errors="replace") in PTY_SIGNALS:
            self.terminal.signal(frame.payload.decode())

    def _pump(self) -> None:
        outcome: dict[str, object]
        try:
            for chunk in self.terminal.output():
                self._send(termwire.encode_output(self.shown(chunk)))
            done = self.terminal.outcome
            outcome = {"exit_code": done.exit_code, "timed_out": done.timed_out, "killed": done.killed} \
                if done is not None else {"error": "the session ended without an exit status"}
        except OSError:
            outcome = {"error": "the client stopped taking the terminal's output"}
        except Exception as exc:
            outcome = {"error": str(exc)[:500]}
        finally:
            self.terminal.close()
        self.ended(outcome)
        try:
            self._send(termwire.encode_exit(outcome))
            self.sock.shutdown(socket.SHUT_RDWR)  # the reader loop ends too
        except OSError:
            pass

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self.sock.sendall(data)
            except OSError:
                self.sock.shutdown(socket.SHUT_RDWR)
                raise


def check_upgrade(ex: Exchange, client: str = "microvm-check jobs attach") -> None:
    """BadRequest unless the request asks for an Upgrade to UPGRADE (`client` is what speaks it)."""
    if ex.headers.get("Upgrade", "").lower() != termwire.UPGRADE:
        raise BadRequest(f"a terminal is an HTTP/1.1 Upgrade to {termwire.UPGRADE!r} ({client})")


def switch(ex: Exchange, client: str = "microvm-check jobs attach") -> tuple[socket.socket, bytes]:
    """Answer 101 (the request asked for UPGRADE); the raw socket and what the client sent after its head."""
    check_upgrade(ex, client)
    return ex.upgrade(termwire.UPGRADE)
