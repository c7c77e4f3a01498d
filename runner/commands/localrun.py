"""`microvm-check run`: one job for a local checkout, through the same API path as the action.

When a service answers on the socket the job goes there (its policy store then decides the egress,
and the job's `--policy` can only narrow it). Otherwise an in-process service is started on a
private socket for just this job; there the operator is the one running the command, so the
job's policy is taken as given (no policy at all means no network).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runner import startup
from runner.attest.statement import ENVELOPE_FILE
from runner.errors import MicrovmCheckError, UserError
from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import DEFAULT_SOCKET, SHA, JobRecord, JobSpec, step_exit_code
from runner.jobapi.pack import PackError, host_git, pack_checkout
from runner.jobapi.terminal import show
from runner.tarsafe import require_patched_python

if TYPE_CHECKING:
    from runner.service.host.assembly import ServiceHost

EXIT_CANCELLED = 130
ARTIFACTS_DIR = "artifacts"
# What stops a `run` as Ctrl-C does: its job is cancelled (the VM destroyed), its private service closed
# and its temporary directory removed, then it exits 128 + the signal. SIGHUP is the closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = subparsers.add_parser(
        "run", help="run a command on a local checkout in a fresh VM",
        description="Pack DIR (without .git), run COMMAND in a fresh VM, stream its output, copy artifacts to "
                    "./artifacts/ and exit with the command's status. Uses the service on --socket when it "
                    "answers, otherwise an in-process service for just this job.",
    )
    run.add_argument("--policy", type=Path, help="egress policy YAML for the job (default: no network)")
    run.add_argument("--template", help="VM template (default: the service's first)")
    run.add_argument("--artifacts", action="append", default=[], metavar="GLOB",
                     help="files to copy back, relative to DIR (repeatable)")
    run.add_argument("--timeout", type=int, default=3600, metavar="SECONDS", help="command timeout (default 3600)")
    run.add_argument("--socket", default=DEFAULT_SOCKET, help=f"the service's socket (default {DEFAULT_SOCKET})")
    run.add_argument("--dir", type=Path, default=Path("."), help="the checkout to send (default .)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    require_patched_python()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UserError("nothing to run: give the command after --, e.g. microvm-check run -- pytest -q")
    policy = None
    if args.policy:
        try:
            policy = args.policy.read_text()
        except OSError as exc:
            raise UserError(f"--policy {args.policy}: cannot read: {exc.strerror}") from exc
    job = LocalRun(directory=args.dir, command=command, policy=policy, template=args.template,
                   artifacts=args.artifacts, timeout_seconds=args.timeout, socket=args.socket)
    return job.run()


class Stopped(KeyboardInterrupt):
    """A stop signal, raised in the main thread where the run is; a KeyboardInterrupt, so every cleanup
    that already handles Ctrl-C handles it too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, _frame: object) -> None:
    # Only the first signal interrupts: later ones must not break the cancel and the cleanup under way.
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise Stopped(signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise `Stopped` while the run lasts; the old handlers come back after.
    (Only the main thread may set handlers: elsewhere, a caller embedding a run keeps its own.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


@dataclass
class LocalRun:
    directory: Path
    command: list[str]
    policy: str | None = None
    template: str | None = None
    artifacts: list[str] = field(default_factory=list)
    timeout_seconds: int = 3600
    socket: str | None = None

    def run(self) -> int:
        with stop_signals():
            return self._run()

    def _run(self) -> int:
        root = self.directory.resolve()
        try:
            checkout = pack_checkout(root)  # walks the whole tree now: refused before a VM is spent
        except PackError as exc:
            raise UserError(f"cannot send the checkout: {exc}") from exc
        out_dir = Path.cwd() / ARTIFACTS_DIR
        if self.artifacts and out_dir.exists() and any(p.name != ENVELOPE_FILE for p in out_dir.iterdir()):
            raise UserError(f"{out_dir} is not empty: move it away so this run's artifacts do not mix with old ones")
        spec = self.spec(root)
        remote = self._remote(spec)
        if remote is not None:
            client, job = remote
            with client:
                return self._drive(client, job, checkout, out_dir)
        with in_process_service(self.template, self.timeout_seconds) as local:
            return self._drive(local, _submit(local, spec), checkout, out_dir)

    def spec(self, root: Path) -> JobSpec:
        command = self.command[0] if len(self.command) == 1 else shlex.join(self.command)
        return JobSpec(
            repository=f"local/{re.sub(r'[^A-Za-z0-9_.-]', '-', root.name) or 'checkout'}",
            sha=_head(root),
            job_name="local",
            event="local",
            command=command,
            artifacts=tuple(self.artifacts),
            timeout_seconds=self.timeout_seconds,
            template=self.template or None,
            policy=self.policy,
        )

    def _remote(self, spec: JobSpec) -> tuple[JobClient, str] | None:
        """The service on the socket and the job submitted to it; None when no service is there. The submit
        is the probe (no health request first): a connection that cannot be made sent nothing, so no job is
        made twice. The client keeps its one connection for the job's requests."""
        if not self.socket or not Path(self.socket).exists():
            return None
        client = JobClient(socket=self.socket, keep_alive=True)
        try:
            return client, _submit(client, spec)
        except JobAPIError:  # unreachable: `_submit` turned every answer of a service into a UserError
            client.close()
            return None
        except BaseException:
            client.close()
            raise

    def _drive(self, client: JobClient, job: str, checkout: Iterator[bytes], out_dir: Path) -> int:
        ended: list[JobRecord] = []
        try:
            for entry in client.upload_and_follow(job, checkout, on_end=ended.append):  # one request for both
                show(entry.stream, entry.data)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP (Stopped)
            _cancel_quietly(client, job)
            _say(f"\nmicrovm-check: cancelled job {job}"
                 + (f" ({signal.Signals(exc.signum).name})" if isinstance(exc, Stopped) else ""))
            return 128 + exc.signum if isinstance(exc, Stopped) else EXIT_CANCELLED
        except OSError as exc:  # our own output is gone (a closed terminal, a closed pipe): nobody watches
            _cancel_quietly(client, job)
            raise UserError(f"job {job} cancelled: cannot write its output: {exc}") from exc
        except (JobAPIError, PackError) as exc:
            _cancel_quietly(client, job)
            raise UserError(f"job {job}: {exc}") from exc
        record = ended[-1] if ended and ended[-1].final else client.get(job)
        if record.artifacts:
            _fetch_artifacts(client, job, out_dir)
        _write_attestation(client, job, out_dir)
        return _exit_status(record)


@contextmanager
def in_process_service(template: str | None, timeout_seconds: int) -> Iterator[JobClient]:
    """A private service (socket, records and VM directory in a temporary directory) for one `run`,
    closed afterwards, the directory removed on every way out (a stop signal is `Stopped`, an exception).

    Its engine restores the one VM the job needs from the host's templates (`MICROVM_CHECK_STATE`) and
    keeps no spare pool: spares would be restored next to the job's only to be thrown away at exit. The
    job's policy is trusted as given, and a job still running at the end is cancelled at once."""
    tmp = Path(tempfile.mkdtemp(prefix="mvc-run-"))
    try:
        with startup.long_lived():  # the service's modules and parts live as long as the run
            host = _start_service(tmp, template, timeout_seconds)
        try:
            with JobClient(socket=str(tmp / "api.sock"), keep_alive=True) as client:
                yield client
        finally:
            _ignore_stop_signals()  # the cleanup runs to its end: the job is cancelled, its VM destroyed
            host.close()
    finally:
        _ignore_stop_signals()
        shutil.rmtree(tmp, ignore_errors=True)


def _start_service(tmp: Path, template: str | None, timeout_seconds: int) -> ServiceHost:
    """The private service of `in_process_service`, started, its socket at tmp/api.sock."""
    from runner.service.config.reading import config_from_mapping
    from runner.service.host.assembly import EngineSettings, ServiceHost
    from runner.service.jobs.egress import EgressPolicies
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    config = config_from_mapping({
        "socket": str(tmp / "api.sock"), "state_dir": str(tmp / "state"),
        "templates": [template or "base"], "max_concurrent_jobs": 1, "max_queued_jobs": 1,
        "max_timeout_seconds": max(timeout_seconds, 1), "default_timeout_seconds": max(timeout_seconds, 1),
        "prewarm": {"max_vms": 0}, "shutdown_grace_seconds": 0,
        # signed with the host's own key (the one `serve` makes in the default state dir), not one thrown away
        "attestation_key": str(StateDir.default().root / "attestation-key.pem"),
    })
    engine = EngineSettings(state=StateDir(tmp / "engine"), templates=TemplateStore(StateDir.default().templates),
                            pool_size=0)
    host = ServiceHost(config, engine=engine, policies=EgressPolicies(None, trust_job_policy=True))
    try:
        host.__enter__()  # not `with`: only a failure to start is the user's to fix
    except (MicrovmCheckError, OSError) as exc:
        raise UserError(f"cannot start a service for this run: {exc}") from exc
    return host


def _submit(client: JobClient, spec: JobSpec) -> str:
    """The new job's id; a refusal is the user's to read (an unreachable service is the caller's to handle)."""
    try:
        return client.submit(spec).id
    except JobAPIError as exc:
        if exc.unreachable:
            raise
        raise UserError(f"the service refused the job: {exc}") from exc


def _ignore_stop_signals() -> None:
    """From here on a stop signal changes nothing: what it would do (cancel, close, remove) is under way.
    `stop_signals` puts the caller's handlers back when the run returns."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _say(line: str) -> None:
    """A line to the user's terminal, which may be gone already (a SIGHUP)."""
    try:
        print(line, file=sys.stderr)
    except OSError:
        pass


def _exit_status(record: JobRecord) -> int:
    """The step's status as the action decides it (`contract.step_exit_code`), the error said first."""
    if record.error:
        print(f"microvm-check: job {record.id} {record.state}: {record.error}", file=sys.stderr)
    return step_exit_code(record.state, record.exit_code)


def _write_attestation(client: JobClient, job: str, out_dir: Path) -> None:
    """The job's signed record as ./artifacts/microvm-check.intoto.jsonl (the next run replaces it)."""
    try:
        data = client.attestation(job)
        out_dir.mkdir(exist_ok=True)
        (out_dir / ENVELOPE_FILE).write_bytes(data)
    except (JobAPIError, OSError) as exc:
        _say(f"microvm-check: job {job}: its signed record was not written: {exc}")
        return
    _say(f"microvm-check: signed job record in {out_dir / ENVELOPE_FILE} (microvm-check verify checks it)")


def _fetch_artifacts(client: JobClient, job: str, out_dir: Path) -> None:
    from runner import tarsafe

    out_dir.mkdir(exist_ok=True)
    with tempfile.TemporaryFile(dir=out_dir.parent) as spool:
        client.artifacts(job, spool)
        spool.seek(0)
        try:
            done = tarsafe.extract(spool, out_dir)
        except tarsafe.UnsafeTar as exc:
            raise UserError(f"job {job}: refused its artifacts: {exc}") from exc
    print(f"microvm-check: {len(done.files)} artifact file(s) in {out_dir}", file=sys.stderr)


def _cancel_quietly(client: JobClient, job: str) -> None:
    try:
        client.cancel(job)
    except JobAPIError:
        pass


def _head(root: Path) -> str:
    """The checkout's commit when it is a git work tree (for the record), else zeros. A directory with no
    `.git` in it or above it is none, as git would say, without starting git (10-25 ms of the run)."""
    if not any((directory / ".git").exists() for directory in (root, *root.parents)):
        return "0" * 40
    try:
        out = host_git("-C", str(root.resolve()), "rev-parse", "HEAD", timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "0" * 40
    sha = out.stdout.decode(errors="replace").strip()
    return sha if SHA.fullmatch(sha) else "0" * 40
