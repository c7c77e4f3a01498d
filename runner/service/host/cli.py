"""`microvm-check serve | jobs`: the job service and its records (`run` is runner/commands/localrun.py)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from runner.errors import UserError
from runner.jobapi.contract import DEFAULT_SOCKET, JobRecord
from runner.logs import FORMATS
from runner.logs import setup as setup_logging

if TYPE_CHECKING:
    from runner.jobapi.client import JobClient

# The service's config and records are imported by the commands that use them, not here: `jobs` on a
# socket needs neither, and the config pulls in the GitHub and policy layers (runner/cli.py).

T = TypeVar("T")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser("serve", help="run the job service (API on a Unix socket)")
    serve.add_argument("--config", required=True, type=Path, help="the service's YAML config")
    serve.add_argument("--log-format", choices=FORMATS, help="text, or json: one object per line, job events with "
                                                             "their job id (default: the config's log_format, text)")
    serve.set_defaults(func=cmd_serve)

    jobs = subparsers.add_parser("jobs", help="list job records")
    jobs.add_argument("--json", action="store_true", help="one JSON object per line")
    jobs.add_argument("--limit", type=int, default=20, help="how many, newest first (default 20)")
    jobs.add_argument("--socket", default=DEFAULT_SOCKET, help="ask the running service on this socket")
    jobs.add_argument("--config", type=Path, help="read the records of this service config directly")
    jobs.set_defaults(func=cmd_jobs)
    actions = jobs.add_subparsers(dest="jobs_command", metavar="ACTION")
    show = actions.add_parser("show", help="one job's record: state, result, timings, error, artifacts")
    logs = actions.add_parser("logs", help="one job's log (stdout, stderr and the service's notes)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep following until the job ends")
    cancel = actions.add_parser("cancel", help="cancel a job: its VM is destroyed, its record says cancelled")
    attach = actions.add_parser("attach", help="a shell on a terminal in a running (or kept) job's VM (the operator, or "
                                               "attach_group); Ctrl-] detaches, the job runs on")
    run = actions.add_parser("exec", help="one command on a terminal in a running (or kept) job's VM: jobs exec ID -- CMD")
    for action, func in ((show, cmd_jobs_show), (logs, cmd_jobs_logs), (cancel, cmd_jobs_cancel),
                         (attach, cmd_jobs_attach), (run, cmd_jobs_attach)):
        action.add_argument("id", help="the job's id (as `jobs` lists it)")
        action.add_argument("--socket", default=argparse.SUPPRESS,
                            help=f"the running service's socket (default: the config's, or {DEFAULT_SOCKET})")
        action.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="the service config: its socket")
        action.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON, not text")
        action.set_defaults(func=func)
    run.add_argument("argv", nargs="+", metavar="CMD", help="the command and its arguments (after --)")


# -- serve ----------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from runner.service.config.reading import load_config
    from runner.tarsafe import require_patched_python

    require_patched_python()
    from runner.service.host.assembly import ServiceHost

    config = load_config(args.config)
    setup_logging("debug" if getattr(args, "verbose", False) else config.log_level, args.log_format or config.log_format)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        with ServiceHost(config, origin=str(args.config)) as host:
            assert host.api is not None
            bound = host.listening()  # with the ports the kernel chose where the config said 0
            print(f"microvm-check: serving jobs on {config.socket}"
                  + (f" and {bound['api']}" if bound["api"] else "")
                  + (f"; GitHub's webhook on {bound['webhook']}" if bound["webhook"] else ""), file=sys.stderr)
            stop.wait()
            print("microvm-check: shutting down: finishing running jobs, destroying every VM", file=sys.stderr)
    except OSError as exc:  # a file, a port, a socket the host cannot use: the OS's message names it
        raise UserError(str(exc)) from exc
    return 0


# -- jobs -----------------------------------------------------------------------------------------


def cmd_jobs(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise UserError("--limit must be at least 1")
    if args.config:
        from runner.service.config.reading import load_config
        from runner.service.jobs.records import RecordStore

        store = RecordStore(load_config(args.config).records_path)
        try:
            records = store.list(args.limit)
        finally:
            store.close()
    else:
        _require_socket(args.socket, "or pass --config to read its records directly")
        from runner.jobapi.client import JobAPIError, JobClient

        try:
            with JobClient(socket=args.socket) as client:
                records = client.list(args.limit)
        except JobAPIError as exc:
            raise UserError(f"{exc} (is the service running? or pass --config to read its records directly)") from exc
    for rec in records:
        print(json.dumps(rec.to_wire()) if args.json else _row(rec))
    return 0


def _require_socket(socket: str, hint: str) -> None:
    """A socket path where nothing is is a service that is not running: said without loading the HTTP
    client, which is most of these commands' start-up (a socket that is there is asked)."""
    if not Path(socket).exists():
        raise UserError(f"cannot reach the job service at {socket}: there is no socket there "
                        f"(is the service running? {hint})")


def _job_client(args: argparse.Namespace) -> JobClient:
    """A client of the running service: a job's record, log and cancel go through the API, whose operator
    check (root or the admin_group; a runner only its own jobs) decides who reaches which job."""
    from runner.jobapi.client import JobClient

    return JobClient(socket=_socket_of(args))


def _socket_of(args: argparse.Namespace) -> str:
    """The running service's socket: --socket, else the config's, which must be there."""
    socket: str = args.socket
    if args.config is not None and socket == DEFAULT_SOCKET:
        from runner.service.config.reading import load_config

        socket = load_config(args.config).socket
    _require_socket(socket, "pass its --socket")
    return socket


def _api_call(args: argparse.Namespace, call: Callable[[JobClient], T]) -> T:
    client = _job_client(args)  # refused before the HTTP client loads when there is no socket
    from runner.jobapi.client import JobAPIError

    try:
        with client:
            return call(client)
    except JobAPIError as exc:
        hint = {403: " (jobs of others are for the operator: root or the config's admin_group)",
                404: " (`microvm-check jobs` lists the ids)"}.get(exc.status or 0, "")
        if exc.status is None:
            hint = " (is the service running? pass its --socket)"
        raise UserError(f"{exc}{hint}") from exc


def cmd_jobs_show(args: argparse.Namespace) -> int:
    rec = _api_call(args, lambda client: client.get(args.id))
    if getattr(args, "json", False):
        print(json.dumps(rec.to_wire(), indent=2))
        return 0
    t = rec.timings
    print(_row(rec))
    print(f"    state {rec.state.value}, result {result_text(rec)}; VM {rec.vm_id or '-'}"
          + (" (warm)" if rec.warm else "") + f"; policy {rec.policy_digest or '-'}")
    print(f"    run {rec.run_id or '-'} attempt {rec.run_attempt or '-'}; created {_when(rec.created_at)}, started "
          f"{_when(t.started_at)}, finished {_when(t.finished_at)}"
          + (f"; VM ready in {t.vm_ready_ms:.0f} ms" if t.vm_ready_ms is not None else ""))
    if rec.restored_from is not None:
        print(f"    restored from {rec.restored_from.describe()}")
    for item in rec.artifacts:
        print(f"    artifact {item.path[:200]} ({item.size} bytes)")
    if rec.blocked_egress:
        print(f"    blocked egress: {sum(b.count for b in rec.blocked_egress)} attempt(s)")
    return 0


def result_text(rec: JobRecord) -> str:
    if rec.state.value == "finished":
        return "success" if rec.exit_code == 0 else f"failure (exit {rec.exit_code})"
    return rec.state.value if rec.final else "not yet"


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch)) if epoch else "-"


def cmd_jobs_logs(args: argparse.Namespace) -> int:
    """The log as `run` shows it: stdout to stdout, stderr and the service's notes to stderr, and on a
    terminal the guest's control characters defused."""
    from runner.jobapi.terminal import show

    def relay(client: JobClient) -> None:
        for entry in client.logs(args.id, follow=args.follow):
            if getattr(args, "json", False):
                print(json.dumps({"seq": entry.seq, "stream": entry.stream, "ts": entry.ts,
                                  "data": entry.data.decode("utf-8", "replace")}), flush=True)
            else:
                show(entry.stream, entry.data)
    _api_call(args, relay)
    return 0


def cmd_jobs_attach(args: argparse.Namespace) -> int:
    """`jobs attach` (the shell) and `jobs exec` (argv): the session's exit code, 1 when it ended without one."""
    from runner.jobapi.termclient import TerminalRefused, run_session

    socket = _socket_of(args)
    try:
        ended = run_session(socket, args.id, list(getattr(args, "argv", None) or []))
    except TerminalRefused as exc:
        raise UserError(f"cannot attach to job {args.id}: {exc}") from exc
    except OSError as exc:
        raise UserError(f"cannot attach to job {args.id}: {exc} (is the service running? pass its --socket)") from exc
    if ended.get("detached"):
        print(f"\r\ndetached from job {args.id}; it runs on", file=sys.stderr)
        return 0
    if "error" in ended:
        print(f"\r\nthe terminal session ended: {ended['error']}", file=sys.stderr)
        return 1
    code = ended.get("exit_code")
    return code if isinstance(code, int) and not isinstance(code, bool) else 1


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    rec = _api_call(args, lambda client: client.cancel(args.id))
    print(json.dumps(rec.to_wire()) if getattr(args, "json", False) else
          f"job {rec.id}: {rec.state.value}" + (" (it had already ended)" if rec.final and rec.state.value != "cancelled"
                                                 else ""))
    return 0


def _row(rec: JobRecord) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.created_at))
    code = "-" if rec.exit_code is None else str(rec.exit_code)
    t = rec.timings
    took = f"{t.finished_at - t.started_at:.1f}s" if t.finished_at and t.started_at else "-"
    flags = " warm" if rec.warm else ""
    line = (f"{rec.id}  {when}  {rec.state.value:<17} exit {code:>3}  {took:>7}  "
            f"{rec.repository}@{rec.sha[:8]} {rec.job_name}{flags}")
    return line + (f"\n    error: {rec.error}" if rec.error else "")
