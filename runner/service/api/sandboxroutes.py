"""The interactive sandboxes' routes on the job API (runner/service/jobs/sandboxes.py; docs/sdk.md). Their
paths, headers and bodies are the SDK's contract (microvm_check/contract.py, its records in brackets):

    POST /v1/sandboxes                      [CreateRequest] -> 201 [CreateAnswer]: SandboxInfo and token
    GET  /v1/sandboxes/<id>                 -> [SandboxInfo]
    POST /v1/sandboxes/<id>/exec            [ExecRequest] -> NDJSON: [ExecOutput] lines, then [ExecEnd]
                                            (or [ErrorAnswer] once the answer had begun)
    PUT  /v1/sandboxes/<id>/files?path=P&mode=644   body: the file's bytes -> 204
    GET  /v1/sandboxes/<id>/files?path=P            -> the file's bytes
    GET  /v1/sandboxes/<id>/files/list?path=D       -> [Listing] of [FileEntry]
    PUT  /v1/sandboxes/<id>/upload?dest=D           body: a tar -> 204
    GET  /v1/sandboxes/<id>/download?glob=G&cwd=D   -> a tar (regular files only, re-written on the host)
    POST /v1/sandboxes/<id>/snapshot                -> 201 [SnapshotAnswer] for a create's `base`
    POST /v1/sandboxes/<id>/hibernate               -> 200 [SandboxInfo], state hibernated: its VM kept and stopped
    POST /v1/sandboxes/<id>/resume                  -> 200 [SandboxInfo]: its VM restored where it was
    POST /v1/sandboxes/<id>/destroy                 -> 200 [DestroyAnswer]
    GET  /v1/sandboxes/<id>/terminal?[TerminalRequest]  Upgrade: microvm-check-terminal -> 101, then the
                                            terminal's frames both ways, [TerminalEnd] last (termsession.py)

Creating needs the operator or a member of `sandboxes.group` on the Unix socket (its peer uid, as the
kernel reports it); everything else needs the sandbox's own token (SANDBOX_TOKEN_HEADER), checked on
the request's head, before its body is read.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import re
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from microvm_check.contract import (
    MAX_BLOCKED,
    SANDBOX_ID,
    SANDBOXES,
    SKIPPED_HEADER,
    WORKSPACE,
    CreateAnswer,
    DestroyAnswer,
    ErrorAnswer,
    ExecEnd,
    ExecOutput,
    ExecRequest,
    Listing,
    Route,
    SnapshotAnswer,
    TerminalRequest,
    WireError,
)
from microvm_check.contract import SANDBOX_TOKEN_HEADER as SANDBOX_TOKEN_HEADER  # gates.py reads it here
from runner.errors import MicrovmCheckError
from runner.jobapi.contract import JobState
from runner.service.api.refusals import MethodNotAllowed, NoRoute
from runner.service.api.termsession import TerminalSession, check_upgrade, switch
from runner.service.jobs.auth import Access, Caller, in_group, peer_ids
from runner.service.jobs.sandboxes import (
    LiveSandbox,
    SandboxCallError,
    SandboxDesk,
    SandboxRefused,
    SandboxRequest,
    clean_download,
    guest_path,
    log_output,
    parse_listing,
    read_request,
    spool_tar,
)
from runner.uidrange import RUNNER_UIDS

if TYPE_CHECKING:
    from runner.sandbox.terminal import Terminal
    from runner.service.api.exchange import Exchange

log = logging.getLogger(__name__)

_ROUTE = re.compile(re.escape(SANDBOXES) + r"(?:/(?P<id>" + SANDBOX_ID.pattern + r")(?P<rest>"
                    + "|".join(re.escape(r.value) for r in Route if r.value) + r")?)?")
_CHUNK = 1024 * 1024
MAX_GLOBS = 64
# a terminal's program when the caller names none: the template's bash if it has one, else its sh
SHELL = ["/bin/sh", "-c", "if [ -x /bin/bash ]; then exec /bin/bash -i; fi; exec /bin/sh -i"]
TERM_NAME = "xterm-256color"  # a terminal's TERM unless the caller's env names one


def route(path: str) -> tuple[str | None, Route] | None:
    """(sandbox id or None for the collection, its call) for a sandbox path, else None."""
    match = _ROUTE.fullmatch(path)
    return (match.group("id"), Route(match.group("rest") or "")) if match else None


def owner_of(access: Access, settings_group: str | None, caller: Caller, sock: object | None,
             runner_user: str | None = None) -> str:
    """The owner key of a caller that may create sandboxes, or SandboxRefused saying who may.

    A runner's processes run a fork's own workflow steps on the host: they never create sandboxes, not
    by leaving out their runner token, nor through the group (a fleet runner's own uid, or the
    configured `runners.runner_user`, whatever groups it is in)."""
    if caller.operator:
        return "operator"
    if caller.runner is None and sock is not None and settings_group:
        uid, gid = peer_ids(sock)  # type: ignore[arg-type]
        if uid in RUNNER_UIDS or (runner_user is not None and _user_name(uid) == runner_user):
            raise SandboxRefused(f"{caller.who} is a runner's user, whose processes run workflow steps of "
                                 "pull requests: it may not create sandboxes, whatever its groups")
        try:
            group_id = grp.getgrnam(settings_group).gr_gid
        except KeyError:
            group_id = None
        if group_id is not None and in_group(uid, gid, group_id):
            return f"uid {uid}"
    allowed = f"members of group {settings_group!r} (sandboxes.group)" if settings_group else "nobody else"
    raise SandboxRefused(f"{caller.who} may not create sandboxes: the operator may, and {allowed}")


def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def vet(desk: SandboxDesk, access: Access, caller: Caller, sock: object | None, path: str,
        token: str | None) -> None:
    """The head's check for a POST or PUT under /v1/sandboxes (raises the refusal)."""
    found = route(path)
    if found is None:
        return
    sandbox_id, _rest = found
    if sandbox_id is None:
        owner_of(access, desk.settings.group, caller, sock, desk.config.runners.runner_user)
    else:
        desk.find(sandbox_id, token, caller.operator)


def answer(ex: Exchange, params: Mapping[str, str]) -> None:
    """/v1/sandboxes and below (runner/service/api/paths.py), on a service that runs sandboxes."""
    desk = ex.listener.sandboxes
    if desk is None:
        raise NoRoute("this service offers no interactive sandboxes (it runs no VM engine of its own)")
    SandboxRoutes(ex, desk).answer(ex.method, params["path"], ex.query, ex.caller(), ex.peer())


class SandboxRoutes:
    """Answers one request on a sandbox route."""

    def __init__(self, exchange: Exchange, desk: SandboxDesk) -> None:
        self.h, self.desk = exchange, desk

    def answer(self, method: str, path: str, query: dict[str, list[str]], caller: Caller, sock: object | None) -> None:
        found = route(path)
        if found is None:
            raise NoRoute(f"no route {method} {path}; see docs/sdk.md")
        sandbox_id, rest = found
        if sandbox_id is None:
            if method != "POST":
                return self._not_allowed(method, path)
            owner = owner_of(self.h.service.access, self.desk.settings.group, caller, sock,
                             self.desk.config.runners.runner_user)
            return self._create(owner)
        sandbox = self.desk.find(sandbox_id, self.h.headers.get(SANDBOX_TOKEN_HEADER), caller.operator)
        handler: Callable[[], None] | None = {
            ("GET", Route.INFO): lambda: self.h.send_json(200, self.desk.info(sandbox).to_wire()),
            ("POST", Route.EXEC): lambda: self._exec(sandbox),
            ("PUT", Route.FILES): lambda: self._write(sandbox, query),
            ("GET", Route.FILES): lambda: self._read(sandbox, query),
            ("GET", Route.FILES_LIST): lambda: self._list(sandbox, query),
            ("PUT", Route.UPLOAD): lambda: self._upload(sandbox, query),
            ("GET", Route.DOWNLOAD): lambda: self._download(sandbox, query),
            ("POST", Route.SNAPSHOT): lambda: self._snapshot(sandbox),
            ("POST", Route.HIBERNATE): lambda: self._hibernate(sandbox),
            ("POST", Route.RESUME): lambda: self._resume(sandbox),
            ("POST", Route.DESTROY): lambda: self._destroy(sandbox),
            ("GET", Route.TERMINAL): lambda: self._terminal(sandbox, query),
        }.get((method, rest))
        if handler is None:
            return self._not_allowed(method, path)
        handler()

    @staticmethod
    def _not_allowed(method: str, path: str) -> None:
        raise MethodNotAllowed(f"{method} is not allowed on {path}; see docs/sdk.md")

    # -- the routes ------------------------------------------------------------------------------------

    def _create(self, owner_key: str) -> None:
        from runner.service.jobs.sandboxes import Owner

        request = SandboxRequest.parse(self.h.json_body(), self.desk.config)
        sandbox, token = self.desk.create(Owner(owner_key, owner_key == "operator"), request)
        self.h.send_json(201, CreateAnswer(self.desk.info(sandbox), token).to_wire())

    def _exec(self, sandbox: object) -> None:
        from runner.service.jobs.sandboxes import LiveSandbox

        assert isinstance(sandbox, LiveSandbox)
        settings = self.desk.settings
        command, timeout, cwd, env, stdin = _exec_request(self.h.json_body(), settings.exec_timeout_seconds)
        stream: _ExecStream | None = None
        try:
            with self.desk.call(sandbox) as live:
                live.log.system(f"exec: {json.dumps(command)[:1000]}")
                stream = _ExecStream(self.h, log_output(live.log), settings.exec_output_bytes, live.vm)
                result = live.vm.exec(command, timeout_seconds=timeout, env=env, cwd=cwd, on_output=stream,
                                      capture_bytes=0, stdin=stdin)
                self.desk.note_blocked(live)
                end = ExecEnd(result.exit_code, result.timed_out, stream.over, round(result.duration_ms, 3),
                              tuple(live.record.blocked_egress[:MAX_BLOCKED]))
                live.log.system(f"exec ended: exit {result.exit_code}{' (timed out)' if result.timed_out else ''}")
                stream.finish(end)
        except (ConnectionError, TimeoutError):
            raise  # the caller is gone: its sandbox stays until its TTL (or its destroy)
        except Exception as exc:
            if stream is None or not stream.started:
                raise  # nothing was sent yet: the refusal gets its own status (a program that does not start: 400)
            stream.fail(exc)

    def _write(self, sandbox: object, query: dict[str, list[str]]) -> None:
        """The call's slot is taken before the body is read (a refused PUT reads none of it), and the body
        goes to a spool file in the sandbox's own directory, not into the service's memory."""
        path = guest_path(_one(query, "path"))
        mode = _mode(_one(query, "mode") or "644")
        limit = self.desk.settings.file_max_bytes
        with self.desk.call(sandbox) as live:  # type: ignore[arg-type]
            spool = self._spool(live, "write.spool")
            try:
                with open(spool, "w+b") as out:
                    written = 0
                    for chunk in self.h.body():
                        written += len(chunk)
                        if written > limit:
                            self.h.close_connection = True
                            raise SandboxCallError(f"the file is larger than {limit} bytes (sandboxes.file_max_bytes)")
                        out.write(chunk)
                    out.seek(0)
                    live.vm.files.write(path, out, mode)
            finally:
                spool.unlink(missing_ok=True)
        self.h.respond(204, b"", {})

    def _read(self, sandbox: object, query: dict[str, list[str]]) -> None:
        path = guest_path(_one(query, "path"))
        with self.desk.call(sandbox) as live:  # type: ignore[arg-type]
            data = live.vm.files.read(path, max_bytes=self.desk.settings.file_max_bytes)
        self.h.respond(200, data, {"Content-Type": "application/octet-stream"})

    def _list(self, sandbox: object, query: dict[str, list[str]]) -> None:
        path = guest_path(_one(query, "path") or WORKSPACE)
        argv = ["find", path, "-mindepth", "1", "-maxdepth", "1", "-printf", "%y %s %P\\0"]
        with self.desk.call(sandbox) as live:  # type: ignore[arg-type]
            result = live.vm.exec(argv, timeout_seconds=60, env={}, cwd="/", capture_bytes=4 * 1024 * 1024)
        if result.exit_code != 0 and not result.stdout:
            raise SandboxCallError(f"cannot list {path}: {result.stderr[-300:].decode('utf-8', 'replace')}")
        self.h.send_json(200, Listing(path, tuple(parse_listing(result.stdout)), result.truncated).to_wire())

    def _upload(self, sandbox: object, query: dict[str, list[str]]) -> None:
        from runner.errors import ArchiveError

        dest = guest_path(_one(query, "dest") or WORKSPACE, "dest")
        with self.desk.call(sandbox) as live:  # type: ignore[arg-type]
            spool = self._spool(live, "upload.tar")
            try:
                spool_tar(self.h.body(), spool, self.desk.settings.file_max_bytes)
            except ArchiveError as exc:
                self.h.close_connection = True
                raise SandboxCallError(f"upload: {exc}") from exc
            try:
                with open(spool, "rb") as tar:
                    live.vm.put_tar(tar, dest)
            finally:
                spool.unlink(missing_ok=True)
            live.log.system(f"upload into {dest}")
        self.h.respond(204, b"", {})

    def _download(self, sandbox: object, query: dict[str, list[str]]) -> None:
        globs = query.get("glob") or []
        if not globs or len(globs) > MAX_GLOBS or any(not g or "\0" in g or len(g) > 1024 for g in globs):
            raise SandboxCallError(f"glob: give 1 to {MAX_GLOBS} patterns, relative to cwd")
        cwd = guest_path(_one(query, "cwd") or WORKSPACE, "cwd")
        limit = self.desk.settings.file_max_bytes
        with self.desk.call(sandbox) as live:  # type: ignore[arg-type]
            raw, clean = self._spool(live, "download.raw"), self._spool(live, "download.tar")
            try:
                with open(raw, "wb") as out:
                    live.vm.get_tar(globs, out, limit + 1536 * 10_002, cwd=cwd)
                with open(raw, "rb") as src, open(clean, "wb") as dst:
                    skipped = clean_download(src, dst, limit, globs)
                raw.unlink()
                with open(clean, "rb") as f:
                    self._send_file(f, os.fstat(f.fileno()).st_size, len(skipped))
            finally:
                raw.unlink(missing_ok=True)
                clean.unlink(missing_ok=True)

    def _spool(self, live: LiveSandbox, name: str) -> Path:
        """A file of this request's own in the sandbox's directory: the worker's thread serves one request
        at a time, and its clean-up runs before it takes the next. A fixed name was shared by the sandbox's
        calls: one download's clean-up, after its answer had gone, removed the next one's file (a 500)."""
        return self.desk.config.jobs_dir / live.id / f"{threading.get_ident()}-{name}"

    def _send_file(self, f: object, size: int, skipped: int) -> None:
        self.h.start_response(200, {"Content-Type": "application/x-tar", "Content-Length": str(size),
                                    SKIPPED_HEADER: str(skipped)})
        left = size
        while left:
            data = f.read(min(left, _CHUNK))  # type: ignore[attr-defined]
            if not data:
                raise OSError("the download shrank while being sent")
            self.h.send_data(data)
            left -= len(data)
        self.h.end_response()

    def _snapshot(self, sandbox: object) -> None:
        with self.desk.call(sandbox) as live:  # type: ignore[arg-type]
            name = self.desk.snapshot(live)
        self.h.send_json(201, SnapshotAnswer(name).to_wire())

    def _hibernate(self, sandbox: LiveSandbox) -> None:
        self.desk.hibernate(sandbox)
        self.h.send_json(200, self.desk.info(sandbox).to_wire())

    def _resume(self, sandbox: LiveSandbox) -> None:
        self.desk.resume(sandbox)
        self.h.send_json(200, self.desk.info(sandbox).to_wire())

    def _terminal(self, sandbox: LiveSandbox, query: dict[str, list[str]]) -> None:
        """The whole session, on the request's worker, holding one of the sandbox's calls: refused with a status
        until its program started (the Upgrade not asked, a bad query, a program that does not start), then
        101 and the stream; the sandbox lives on after it, unless its VM went meanwhile."""
        check_upgrade(self.h, "microvm_check's Sandbox.terminal()")
        try:
            request = TerminalRequest.from_query(query)
        except WireError as exc:
            raise SandboxCallError(str(exc)) from exc
        settings = self.desk.settings
        with self.desk.call(sandbox) as live:
            terminal = _open_terminal(live, request, settings.exec_timeout_seconds)
            try:
                raw, buffered = switch(self.h, "microvm_check's Sandbox.terminal()")
                _SandboxSession(raw, buffered, terminal, live, settings.exec_output_bytes).serve()
            finally:
                terminal.close()
        if not sandbox.vm.alive:
            self.desk.end(sandbox, JobState.FAILED, "its VM failed during a terminal session")

    def _destroy(self, sandbox: object) -> None:
        from runner.service.jobs.sandboxes import LiveSandbox

        assert isinstance(sandbox, LiveSandbox)
        self.desk.end(sandbox, JobState.FINISHED, "destroyed by its caller")
        self.h.send_json(200, DestroyAnswer(sandbox.id).to_wire())


class _SandboxSession(TerminalSession):
    """A terminal of a sandbox's caller (a program, not an operator's terminal): the guest's output goes
    out as it came, and into the sandbox's log until that is full; past `budget` bytes of it
    (sandboxes.exec_output_bytes) the session ends and its program with it."""

    def __init__(self, sock: socket.socket, buffered: bytes, terminal: Terminal, live: LiveSandbox,
                 budget: int) -> None:
        super().__init__(sock, buffered, terminal, live.id)
        self.live, self.left = live, budget
        self.budget = budget
        self.log = log_output(live.log)

    def shown(self, chunk: bytes) -> bytes:
        if len(chunk) > self.left:
            raise SandboxCallError(f"the terminal's output passed {self.budget} bytes (sandboxes.exec_output_bytes): "
                                   "its program was ended")
        self.left -= len(chunk)
        self.log("stdout", chunk)
        return chunk

    def note(self, text: str) -> None:
        self.live.log.system(f"terminal: {text}")

    def ended(self, outcome: dict[str, object]) -> None:
        self.live.log.system(f"terminal ended: {json.dumps(outcome)}")


class _ExecStream:
    """An exec's answer: its output to the caller and the sandbox's log, up to the output budget (past
    it the sandbox's commands are killed, from a thread of their own), then its result or an error line.

    The answer's head goes out with the first line, not before: a command that does not start is still
    refused with its own status. Once it is out, whatever goes wrong ends the stream with an error
    line the client reads, never with a body cut short."""

    def __init__(self, exchange: Exchange, log: Callable[[str, bytes], None], budget: int, vm: object) -> None:
        self.h, self.log, self.left, self.vm = exchange, log, budget, vm
        self.over = False
        self.started = False

    def __call__(self, stream: str, data: bytes) -> None:
        if self.over:
            return
        if len(data) > self.left:
            data, self.over = data[: self.left], True
            threading.Thread(target=self._stop, daemon=True).start()
        self.left -= len(data)
        if data:
            self.log(stream, data)
            self._send(ExecOutput(stream, data).to_wire())

    def finish(self, end: ExecEnd) -> None:
        self._send(end.to_wire())
        self.h.end_response()

    def fail(self, exc: Exception) -> None:
        """End the stream with the reason: a project error's message is complete; anything else is a bug
        of ours, logged with its traceback and not shown."""
        if isinstance(exc, MicrovmCheckError):
            message = str(exc)
        else:
            log.error("api: sandbox exec failed after its answer began", exc_info=exc)
            message = "internal error in the job service; see its log"
        self._send(ErrorAnswer(message).to_wire())
        self.h.end_response()

    def _send(self, line: object) -> None:
        if not self.started:
            self.h.start_response(200, {"Content-Type": "application/x-ndjson"})
            self.started = True
        self.h.send_data(_line(line))

    def _stop(self) -> None:
        try:
            self.vm.cancel()  # type: ignore[attr-defined]
        except Exception:
            pass  # the VM is gone already: nothing runs on


def _exec_request(data: object, max_timeout: float) -> tuple[str | list[str], float, str, dict[str, str], bytes | None]:
    """An exec's body (the contract's ExecRequest), held to this service's deadline: what VM.exec takes
    (`stdin` is held to MAX_STDIN by the contract, and by the JSON body's own bound)."""
    request = read_request(ExecRequest.from_wire, data)
    timeout = max_timeout if request.timeout_seconds is None else request.timeout_seconds
    if timeout > max_timeout:
        raise SandboxCallError(f"timeout_seconds: expected a number above 0 and at most {max_timeout:g} "
                               "(sandboxes.exec_timeout_seconds)")
    command = request.command if isinstance(request.command, str) else list(request.command)
    return command, timeout, guest_path(request.cwd, "cwd"), dict(request.env), request.stdin


def _open_terminal(sandbox: LiveSandbox, request: TerminalRequest, timeout_seconds: float) -> Terminal:
    """A terminal in the sandbox's VM (the caller holds a call on it meanwhile): the program asked for
    (SHELL when none) on a pty of the size asked, killed with whatever it started past `timeout_seconds`
    (sandboxes.exec_timeout_seconds), when the caller detaches, or when it is closed."""
    cwd = guest_path(request.cwd, "cwd")
    argv = list(request.argv) or SHELL
    sandbox.log.system(f"terminal: {json.dumps(argv)[:1000]} ({request.rows}x{request.cols})")
    return sandbox.vm.terminal(argv, cwd=cwd, env={"TERM": TERM_NAME, **request.env},
                               size=(request.rows, request.cols), timeout_seconds=timeout_seconds)


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def _mode(text: str) -> int:
    if not re.fullmatch(r"[0-7]{3,4}", text):
        raise SandboxCallError(f"mode: expected octal permissions such as 644, got {text[:10]!r}")
    return int(text, 8) & 0o7777


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"
