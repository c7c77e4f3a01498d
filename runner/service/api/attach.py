"""Terminal sessions into a running job's VM, or a failed job's VM kept for debugging (docs/debugging.md):
`GET /v1/jobs/<id>/terminal` (`microvm-check jobs attach` and `jobs exec`; issue 37; the stream is
runner/jobapi/termwire.py).

Who: the operator (root, `admin_group`, the TCP token) or a member of the config's `attach_group` on the
socket, never a runner's user (its processes run pull requests' workflow steps on the host) and never
with a job's own token (the action holds it, in a job a fork may have written). Each session is a
program of its own on a pty in the job's VM, with the job's environment and working directory; several
may be attached at once (MAX_SESSIONS_PER_JOB, each holding an API worker), and closing one (detaching)
ends that program only, never the job. The guest's output reaches the operator through the terminal
filter (runner/service/api/termfilter.py), and the job's log says who attached, what they ran and when
they left. Everything a session sends and receives goes into the job's transcript (runner/service/jobs/
joblog.py `Transcript`: bounded like the log, neutralised where it is shown), and the job's record lists its
sessions (`terminal_sessions`: who, when, how each ended, bytes in and out), which its signed record carries.
"""

from __future__ import annotations

import grp
import json
import logging
import pwd
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.jobapi import termwire
from runner.sandbox.terminal import Terminal
from runner.service.api.refusals import BadRequest
from runner.service.api.termfilter import TerminalFilter
from runner.service.api.termsession import TerminalSession, switch
from runner.service.jobs.auth import Caller, Forbidden, in_group, peer_ids
from runner.service.jobs.job import JobRun
from runner.service.jobs.service import JobStateConflict
from runner.uidrange import RUNNER_UIDS
from runner.vm.guestwire import PTY_MAX_SIDE

if TYPE_CHECKING:
    from runner.service.api.exchange import Exchange

log = logging.getLogger(__name__)

MAX_SESSIONS_PER_JOB = 4
SESSION_SECONDS = 3600.0  # the guest ends a session's program past this
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
        kept = run.debug_until is not None  # a failed job's VM kept for debugging (docs/debugging.md)
        sandbox = run.sandbox if kept or not run.record.final else None
        if sandbox is None or not sandbox.alive or not (kept or run.record.state.value == "running"):
            raise JobStateConflict(f"job {run.record.id} is {run.record.state.value}: a terminal attaches to a "
                                   "running job's VM, or to a failed job's VM kept for debugging")
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


class Session(TerminalSession):
    """One attached client (the session's machinery is termsession.py's, shared with the sandboxes'): the
    terminal's output filtered for the operator's terminal, the job's log saying what happened."""

    def __init__(self, sock: socket.socket, buffered: bytes, terminal: Terminal, run: JobRun, who: str,
                 argv: list[str]) -> None:
        super().__init__(sock, buffered, terminal, run.record.id)
        self.run, self.who = run, who
        self.screen = TerminalFilter()
        self.transcript, self.number = run.terminal_attached(who, argv)
        self.bytes_in = self.bytes_out = 0

    def typed(self, data: bytes) -> None:
        self.transcript.write(self.number, "in", data)
        self.bytes_in += len(data)

    def shown(self, chunk: bytes) -> bytes:
        self.transcript.write(self.number, "out", chunk)
        self.bytes_out += len(chunk)
        return self.screen.feed(chunk)

    def note(self, text: str) -> None:
        self.run.log.system(f"terminal session of {self.who}: {text}")

    def ended(self, outcome: dict[str, object]) -> None:
        self.run.log.system(f"terminal session of {self.who} ended: {json.dumps(outcome)}")
        self.run.terminal_ended(self.number, _ended(outcome), self.bytes_in, self.bytes_out)


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
        Session(raw, buffered, terminal, run, who, ask.argv).serve()
    finally:
        terminal.close()
        detached(run)


def _ended(outcome: dict[str, object]) -> str:
    """How a session ended, for the job's record."""
    if "error" in outcome:
        return str(outcome["error"])
    if outcome.get("timed_out"):
        return f"its program ran past {SESSION_SECONDS:.0f} s and was ended"
    if outcome.get("killed"):
        return "detached: its program was ended"
    return f"its program exited {outcome.get('exit_code')}"
