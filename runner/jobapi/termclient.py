"""The client side of a job's terminal (`microvm-check jobs attach` and `jobs exec`; the stream is
termwire.py): the Upgrade request spoken with h11, then the operator's terminal relayed both ways.

While attached the local terminal is in raw mode (tty.setraw: every key, Ctrl-C included, goes to the
program in the VM) and put back on every way out; a window resize is sent on (SIGWINCH); Ctrl-]
detaches, which ends the session's program and never the job. The service has already filtered the
guest's output for a terminal (runner/service/api/termfilter.py)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import termios
import tty
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlencode

import h11

from runner.errors import ClientError
from runner.jobapi import termwire

DETACH_KEY = b"\x1d"  # Ctrl-]
CONNECT_SECONDS = 30.0
MAX_REFUSAL = 64 * 1024


class TerminalRefused(ClientError):
    """The service answered the terminal request with an error (its status and reason)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def connect(socket_path: str, job_id: str, argv: list[str], size: tuple[int, int]) -> tuple[socket.socket, bytes]:
    """The upgraded connection to the job's terminal, and what the service sent after its 101."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_SECONDS)
    sock.connect(socket_path)
    conn = h11.Connection(h11.CLIENT)
    query = urlencode([("size", f"{size[0]}x{size[1]}"), *(("argv", a) for a in argv)])
    sock.sendall(conn.send(h11.Request(method="GET", target=f"/v1/jobs/{job_id}/terminal?{query}", headers=[
        ("Host", "localhost"), ("Upgrade", termwire.UPGRADE), ("Connection", "Upgrade")])) or b"")
    sock.sendall(conn.send(h11.EndOfMessage()) or b"")
    refusal: h11.Response | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(65536))
        elif isinstance(event, h11.InformationalResponse) and event.status_code == 101:
            sock.settimeout(None)
            return sock, conn.trailing_data[0]
        elif isinstance(event, h11.Response):
            refusal = event
        elif isinstance(event, h11.Data) and len(body) < MAX_REFUSAL:
            body += event.data
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            sock.close()
            status = refusal.status_code if refusal is not None else 0
            raise TerminalRefused(status, _reason(body))


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]


def local_size() -> tuple[int, int]:
    """The local terminal's size as it is now (not $LINES/$COLUMNS, which a resize does not change)."""
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except OSError:
        return 24, 80
    return max(1, size.lines) if size.lines else 24, max(1, size.columns) if size.columns else 80


@contextmanager
def raw_terminal(fd: int) -> Iterator[None]:
    """The local terminal in raw mode for the session, restored on every way out."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def relay(sock: socket.socket, buffered: bytes, stdin: int | None, stdout: int) -> dict[str, object]:
    """Copy keys to the session and its output to `stdout` until it ends or Ctrl-] detaches; its EXIT."""
    frames = termwire.FrameReader(sock.recv, termwire.SERVICE_KINDS, buffered)
    resized = os.pipe()
    previous = signal.signal(signal.SIGWINCH, lambda *_: os.write(resized[1], b"w")) if stdin is not None else None
    try:
        while True:
            watched = [sock.fileno(), resized[0]] + ([stdin] if stdin is not None else [])
            ready = select.select(watched, [], [])[0]
            if resized[0] in ready:
                os.read(resized[0], 64)
                sock.sendall(termwire.encode(termwire.RESIZE, termwire.resize_payload(*local_size())))
            if stdin is not None and stdin in ready:
                keys = os.read(stdin, 4096)
                if not keys or DETACH_KEY in keys:
                    return {"detached": True}
                sock.sendall(termwire.encode(termwire.INPUT, keys))
            if sock.fileno() in ready:
                try:
                    frame = frames.next()
                except termwire.FrameError as exc:  # the contract's (a ValueError), not a ClientError
                    return {"error": f"the service's stream broke the terminal framing: {exc}"}
                if frame is None:
                    return {"error": "the service closed the session"}
                if frame.kind == termwire.EXIT:
                    return dict(json.loads(frame.payload))
                os.write(stdout, frame.payload)
    finally:
        if previous is not None:
            signal.signal(signal.SIGWINCH, previous)
        os.close(resized[0])
        os.close(resized[1])
        sock.close()


def run_session(socket_path: str, job_id: str, argv: list[str]) -> dict[str, object]:
    """A whole session from this process's terminal (or, when stdin is not one, output only)."""
    interactive = os.isatty(sys.stdin.fileno())
    sock, buffered = connect(socket_path, job_id, argv, local_size() if interactive else (24, 80))
    stdout = sys.stdout.fileno()
    if not interactive:
        return relay(sock, buffered, None, stdout)
    with raw_terminal(sys.stdin.fileno()):
        return relay(sock, buffered, sys.stdin.fileno(), stdout)
