"""Terminal sessions into a running job's VM: `GET /v1/jobs/<id>/terminal` (`microvm-check jobs attach`
and `jobs exec`; issue 37; the stream is runner/jobapi/termwire.py).

Who: the operator (root, `admin_group`, the TCP token) or a member of the config's `attach_group` on the
socket, never a runner's user (its processes run pull requests' workflow steps on the host) and never
with a job's own token (the action holds it, in a job a fork may have written). Each session is a
program of its own on a pty in the job's VM, with the job's environment and working directory; several
may be attached at once (MAX_SESSIONS_PER_JOB, each holding an API worker), and closing one (detaching)
ends that program only, never the job. The guest's output reaches the operator through the terminal
filter (runner/service/api/termfilter.py), and the job's log says who attached, what they ran and when
they left.
"""

from __future__ import annotations

import grp
import json
import logging
import pwd
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.jobapi import termwire
from runner.sandbox.terminal import Terminal
from runner.service.api.refusals import BadRequest
from runner.service.api.termfilter import TerminalFilter
from runner.service.jobs.auth import Caller, Forbidden, in_group, peer_ids
from runner.service.jobs.job import JobRun
from runner.service.jobs.service import JobStateConflict
from runner.uidrange import RUNNER_UIDS
from runner.vm.guestwire import PTY_MAX_SIDE, PTY_SIGNALS

if TYPE_CHECKING:
    from runner.service.api.exchange import Exchange

log = logging.getLogger(__name__)

MAX_SESSIONS_PER_JOB = 4
SESSION_SECONDS = 3600.0  # the guest ends a session's program past this
SEND_SECONDS = 10.0  # a client that takes no output for this long is detached (the VM's channel must flow)
MAX_ARGV_BYTES = 16 * 1024
SHELL = ["/bin/bash", "-i"]
TERM_NAME = "xterm-256color"


@dataclass(frozen=True)
class SessionAsk:
    """What a terminal request asks for: the program (the shell when empty) and the terminal's size."""

    argv: list[str]
    size: tuple[int, int]

    @classmethod
    def of(cls, query: dict[str, list[str]]) -> SessionAsk:
        argv = query.get("argv", [])
        if sum(len(a.encode()) for a in argv) > MAX_ARGV_BYTES or any("\x00" in a for a in argv):
            raise BadRequest(f"argv: at most {MAX_ARGV_BYTES} bytes, no NUL characters")
        size = query.get("size", ["24x80"])[-1]
        try:
            rows, cols = termwire.parse_size(size.encode(), PTY_MAX_SIDE)
        except termwire.FrameError as exc:
            raise BadRequest(f"size: {exc}") from None
        return cls(argv or SHELL, (rows, cols))


def who_may_attach(caller: Caller, sock: socket.socket | None, attach_group: str | None) -> str:
    """The caller's name for the job's log, if they may attach a terminal; else Forbidden saying who may."""
    if caller.operator:
        return caller.who
    if caller.runner is None and sock is not None and attach_group:
        uid, gid = peer_ids(sock)
        try:
            account, group_id = pwd.getpwuid(uid), grp.getgrnam(attach_group).gr_gid
        except KeyError:
            account = None
        if account is not None and uid not in RUNNER_UIDS and in_group(uid, gid, group_id):
            return f"{account.pw_name} (uid {uid})"
    allowed = f"and members of group {attach_group!r} (attach_group)" if attach_group else "alone"
    raise Forbidden(f"{caller.who} may not attach a terminal to a job's VM: the operator may, {allowed}; "
                    "a job's own token never does")


def open_terminal(run: JobRun, ask: SessionAsk) -> Terminal:
    """A terminal in the job's VM, with the job's environment in its working directory, counted among the
    job's sessions (give it back with `detached`)."""
    with run.lock:
        sandbox = run.sandbox if not run.record.final else None
        if sandbox is None or not sandbox.alive or run.record.state.value != "running":
            raise JobStateConflict(f"job {run.record.id} is {run.record.state.value}: a terminal attaches to a "
                                   "running job's VM")
        if run.terminals >= MAX_SESSIONS_PER_JOB:
            raise JobStateConflict(f"job {run.record.id} already has {MAX_SESSIONS_PER_JOB} terminal sessions: "
                                   "detach one first")
        run.terminals += 1
    env = {**run.command_env(), "TERM": TERM_NAME}
    try:
        return sandbox.terminal(ask.argv, cwd=run.spec.workdir, env=env, size=ask.size,
                                timeout_seconds=SESSION_SECONDS)
    except BaseException:
        detached(run)
        raise


def detached(run: JobRun) -> None:
    with run.lock:
        run.terminals -= 1


class Session:
    """One attached client, after the 101: its frames in (a reader loop on the request's worker), the
    terminal's output out (a thread of its own, filtered), the EXIT frame last."""

    def __init__(self, sock: socket.socket, buffered: bytes, terminal: Terminal, run: JobRun, who: str) -> None:
        self.sock, self.terminal, self.run, self.who = sock, terminal, run, who
        self.frames = termwire.FrameReader(sock.recv, termwire.CLIENT_KINDS, buffered)
        self.screen = TerminalFilter()
        self._send_lock = threading.Lock()

    def serve(self) -> None:
        pump = threading.Thread(target=self._pump, name=f"terminal-{self.run.record.id}", daemon=True)
        pump.start()
        try:
            self._take_input()
        finally:
            try:
                self.terminal.end()  # detached (or the client broke off): its program ends, the job goes on
            except Exception as exc:
                log.debug("ending a terminal session of job %s: %s", self.run.record.id, exc)
            pump.join()

    def _take_input(self) -> None:
        self.sock.settimeout(None)
        while True:
            try:
                frame = self.frames.next()
            except (termwire.FrameError, OSError) as exc:
                self.run.log.system(f"terminal session of {self.who}: its client broke off ({exc})")
                return
            if frame is None or self.terminal.outcome is not None:
                return
            try:
                self._act(frame)
            except Exception as exc:  # the VM went, a bad resize: the session ends, the job is not ours to end
                self.run.log.system(f"terminal session of {self.who}: {exc}")
                return

    def _act(self, frame: termwire.Frame) -> None:
        if frame.kind == termwire.INPUT:
            self.terminal.write(frame.payload)
        elif frame.kind == termwire.RESIZE:
            self.terminal.resize(*termwire.parse_size(frame.payload, PTY_MAX_SIDE))
        elif frame.payload.decode(errors="replace") in PTY_SIGNALS:
            self.terminal.signal(frame.payload.decode())

    def _pump(self) -> None:
        outcome: dict[str, object]
        try:
            for chunk in self.terminal.output():
                self._send(termwire.encode_output(self.screen.feed(chunk)))
            done = self.terminal.outcome
            outcome = {"exit_code": done.exit_code, "timed_out": done.timed_out, "killed": done.killed} \
                if done is not None else {"error": "the session ended without an exit status"}
        except OSError:
            outcome = {"error": "the client stopped taking the terminal's output"}
        except Exception as exc:
            outcome = {"error": str(exc)[:500]}
        finally:
            self.terminal.close()
        self.run.log.system(f"terminal session of {self.who} ended: {json.dumps(outcome)}")
        try:
            self._send(termwire.encode_exit(outcome))
            self.sock.shutdown(socket.SHUT_RDWR)  # the reader loop ends too
        except OSError:
            pass

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.settimeout(SEND_SECONDS)
            try:
                self.sock.sendall(data)
            except OSError:
                self.sock.shutdown(socket.SHUT_RDWR)
                raise


def switch(ex: Exchange) -> tuple[socket.socket, bytes]:
    """Answer 101 (the request asked for UPGRADE); the raw socket and what the client sent after its head."""
    if ex.headers.get("Upgrade", "").lower() != termwire.UPGRADE:
        raise BadRequest(f"a terminal is an HTTP/1.1 Upgrade to {termwire.UPGRADE!r} (microvm-check jobs attach)")
    return ex.upgrade(termwire.UPGRADE)


def attach(ex: Exchange, job: Callable[[], JobRun], caller: Caller, attach_group: str | None) -> None:
    """The whole life of one attached session, on the request's worker; who may is decided before the job
    is looked up, so the refused learn nothing of it."""
    who = who_may_attach(caller, ex.peer(), attach_group)
    ask = SessionAsk.of(ex.query)
    run = job()
    terminal = open_terminal(run, ask)
    try:
        run.log.system(f"terminal session attached by {who}: {' '.join(ask.argv)[:200]}")
        raw, buffered = switch(ex)
        Session(raw, buffered, terminal, run, who).serve()
    finally:
        terminal.close()
        detached(run)
