"""One job's life in a VM: checkout in, command, logs out, artifacts validated, VM destroyed.

The VM is destroyed on every path out of `JobRun.execute` (success, failure, timeout, cancel, an
engine error, service shutdown): `finally` owns it, and `cancel` from another thread destroys it
at once so a blocked `exec` returns instead of running on. The exceptions: a step of a
`keep: job` session (runner/service/jobs/sessions.py) that ended with a result: its VM goes back to the
session for the job's next step, which attaches to it (no checkout) instead of starting one; and a failed
or timed-out job whose trusted side asks for `debug:` (runner/service/jobs/debugkeep.py): its record turns
final with its VM kept, network cut, held by its worker until the keep's time is up or `cancel` (docs/debugging.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from policy.model import Policy
from runner.errors import CommandNotStarted, JobError, MicrovmCheckError
from runner.jobapi.contract import JobRecord, JobSpec, JobState, RestoredFrom
from runner.sandbox.port import (
    AuditRecord,
    ExecResult,
    Resources,
    SandboxFactory,
    SandboxLike,
    TemplateChoice,
    VMRequest,
)
from runner.service.config.settings import ServiceConfig
from runner.service.jobs import containers
from runner.service.jobs.attestation import ArtifactFacts, JobAttestor, artifact_facts
from runner.service.jobs.command import direct_argv, shell_argv
from runner.service.jobs.joblog import JobLog, LogFull, Transcript
from runner.service.jobs.jobsecrets import JobSecrets, MaskedLog
from runner.service.jobs.outputs import bounded_blocked, collect_artifacts, refused_egress
from runner.service.jobs.sessions import KEEP_MAX_SECONDS, Session, Sessions

log = logging.getLogger(__name__)

EXIT_TIMEOUT = 124
EXIT_CANCELLED = 130
_TTL_MARGIN_SECONDS = 120  # the engine's own hard limit, past the job's timeout, in case we die
_CANCEL_KEEP_WAIT_SECONDS = 30.0  # a cancel waits this long for a kept VM's destruction

CHECKOUT = "checkout.tar"
ARTIFACTS = "artifacts.tar"
LOG = "log.ndjson"


def vm_request(config: ServiceConfig, choice: TemplateChoice, *, ttl_seconds: float, policy: Policy | None,
               job_id: str) -> VMRequest:
    """The VM a job (or one pre-warmed for it, or an interactive sandbox) asks for: restored from the
    template `choice` names, at the service's size for job VMs or the size class its template was baked
    at (the engine checks the two agree), under the policy its network card follows from."""
    shape = config.size(choice.size) if choice.size else config.resources
    return VMRequest(template=choice.template, ttl_seconds=ttl_seconds,
                     resources=Resources(shape.vcpus, shape.memory_mib), policy=policy, job_id=job_id)


@dataclass(frozen=True, kw_only=True)
class AdmittedSpec(JobSpec):
    """A job's spec as admission built it (runner/service/jobs/spec.py `Submission.spec`): what a client may
    leave out on the wire (None there: the service's default) is decided, so no reader asks again.
    Built once; nothing rewrites it."""

    template: str  # as the client named it, or the service's default (its size variant: `TemplateChoice`)
    timeout_seconds: int  # as the client asked, or the service's default


class JobWatcher(Protocol):
    """What hears of a job's VM starting and of its end: the pull request's check run
    (runner/service/github/checkruns.py `CheckRunReporter`). Declared here, filled in by the GitHub wing
    above: a job knows nothing of GitHub."""

    def vm_started(self, run: JobRun) -> None: ...

    def job_ended(self, run: JobRun) -> None: ...

    def close(self) -> None:
        """Once every job has ended: what is still to be said goes out before the service stops."""


@dataclass(frozen=True)
class Admitted:
    """A job as admission decided it (runner/service/jobs/admission.py): its spec, built once; its effective
    egress policy; its secret bindings with their values. What a `JobRun` is opened from."""

    spec: AdmittedSpec
    policy: Policy
    secrets: JobSecrets = field(default_factory=JobSecrets, repr=False)


@dataclass
class JobRun:
    """A job between submit and its final record; shared between its worker and the API threads."""

    record: JobRecord
    spec: AdmittedSpec
    dir: Path
    log: JobLog
    save: Callable[[JobRecord], None]
    policy: Policy | None = None
    prewarmed: SandboxLike | None = None  # the VM restored for it ahead of its submit (runner/service/jobs/prewarm.py)
    lock: threading.Lock = field(default_factory=threading.Lock)
    sandbox: SandboxLike | None = None
    cancel_reason: str | None = None
    trust_env: dict[str, str] = field(default_factory=dict)  # from Sandbox.install_job_ca
    # Its secret bindings with their values and placeholders (runner/service/jobs/jobsecrets.py), in memory only.
    secrets: JobSecrets = field(default_factory=JobSecrets, repr=False)
    uploading: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    session: Session | None = None  # the GitHub job's kept VM this step opens or attaches to
    sessions: Sessions | None = None
    attached: bool = False  # the session already had its VM at submit: no VM start, no checkout
    attestor: JobAttestor | None = None  # signs the final record (runner/service/jobs/attestation.py)
    artifact_facts: ArtifactFacts | None = None  # its artifacts' digests and JUnit totals, once final
    checks: JobWatcher | None = None  # posts its check run on the pull request (runner/service/github/checkruns.py)
    # The template its VM restores from, as its worker chose it (runner/service/jobs/templatechoice.py); None
    # until then. A kept VM's later steps have their first step's.
    choice: TemplateChoice | None = None
    terminals: int = 0  # terminal sessions attached to its VM now (runner/service/api/attach.py)
    # A failed job's VM is kept this long for the operator (runner/service/jobs/debugkeep.py; 0: not kept), and
    # why not when the job's own checkout asked for it.
    debug_seconds: int = 0
    debug_refusal: Callable[[], str | None] | None = None
    debug_until: float | None = None  # while its VM is kept: when the keep ends (wall clock)
    debug_end: threading.Event = field(default_factory=threading.Event)  # cancel: end the keep now
    debug_gone: threading.Event = field(default_factory=threading.Event)  # the kept VM is destroyed
    on_kept: Callable[[], None] | None = None  # its worker's: the job is final, its VM kept (runner/service/jobs/workers.py)
    transcript: Transcript | None = None  # what they sent and received, once one attached

    @property
    def checkout_path(self) -> Path:
        return self.dir / CHECKOUT

    def update(self, **changes: object) -> None:
        with self.lock:
            if self.record.final:
                return  # cancelled meanwhile: the final record stands
            for key, value in changes.items():
                target = self.record.timings if hasattr(self.record.timings, key) else self.record
                setattr(target, key, value)
            self.save(self.record)

    def terminal_attached(self, who: str, argv: list[str]) -> tuple[Transcript, int]:
        """A terminal session attaches: its entry in the record, saved (also once the record is final: a
        session may end just after the job's result), and its number in the transcript."""
        with self.lock:
            if self.transcript is None:
                self.transcript = Transcript(self.dir, self.log.limits)
            number = len(self.record.terminal_sessions) + 1
            self.record.terminal_sessions.append(
                {"session": number, "who": who, "argv": " ".join(argv)[:200], "attached_at": time.time(),
                 "ended_at": None, "ended": None, "bytes_in": 0, "bytes_out": 0})
            self.save(self.record)
            transcript = self.transcript
        transcript.note(number, f"terminal session {number} attached by {who}: {' '.join(argv)[:200]}")
        return transcript, number

    def terminal_ended(self, number: int, ended: str, bytes_in: int, bytes_out: int) -> None:
        with self.lock:
            for entry in self.record.terminal_sessions:
                if entry.get("session") == number:
                    entry.update(ended_at=time.time(), ended=ended[:300], bytes_in=bytes_in, bytes_out=bytes_out)
            self.save(self.record)
            transcript = self.transcript
        if transcript is not None:
            transcript.note(number, f"terminal session {number} ended: {ended[:300]}")

    def cancel(self, reason: str) -> bool:
        """Ask the job to stop; destroys its VM now. False when it had already finished (a VM kept for
        debugging after it stays: `end_keep` ends that)."""
        with self.lock:
            if self.record.final or self.cancel_reason:
                return False
            self.cancel_reason = reason
            sandbox = self.sandbox
        self.log.system(f"cancelling: {reason}")
        if sandbox is not None:
            _destroy(sandbox)
        return True

    def end_keep(self, reason: str) -> bool:
        """Destroy the VM kept for debugging after the job failed (`jobs cancel`, the service's shutdown),
        waiting a while for it to be gone; False when none is kept."""
        with self.lock:
            kept = self.debug_until is not None
            self.debug_end.set()
        if kept:
            log.info("job %s: its kept VM ends: %s", self.record.id, reason)
            self.debug_gone.wait(_CANCEL_KEEP_WAIT_SECONDS)
        return kept

    def finish(self, state: str, exit_code: int | None = None, error: str | None = None) -> None:
        """The final record, signed first when the service signs records (so whoever sees it final finds
        its signed record too); the job's log ends with it, so live followers see the end."""
        facts = artifact_facts(self.dir, ARTIFACTS) if self.attestor is not None and not self.record.final else None
        with self.lock:
            if self.record.final:
                return
            self.record.state = JobState(state)
            self.record.exit_code = exit_code
            self.record.error = error
            self.record.timings.finished_at = time.time()
            if self.attestor is not None and facts is not None:
                self.artifact_facts = facts
                self.attestor.sign(self.dir, self.record, facts)
            self.save(self.record)
        _remove(self.checkout_path)
        self.log.close()
        self.done.set()
        if self.checks is not None:
            self.checks.job_ended(self)

    def execute(self, create: SandboxFactory, config: ServiceConfig, choice: TemplateChoice) -> None:
        """Run the job to its final state, its VM restored from the template `choice` names (or the
        session's kept VM, restored as the first step chose); never raises.

        The record turns final only after the VM is destroyed, so a client that sees the result
        knows the VM is gone.
        """
        self.choice = choice
        sandbox = None
        outcome: tuple[str, int | None, str | None] = ("failed", None, "the job ended without a result")
        try:
            sandbox = self._attach() if self.attached else self._start_vm(create, config, choice)
            outcome = self._run_in(sandbox, config) if sandbox is not None else self._cancelled()
        except LogFull as exc:  # the log already says so; the VM goes in `finally`
            outcome = self._cancelled() if self.cancel_reason else ("failed", None, str(exc))
        except Exception as exc:  # an engine error, a hostile guest: the job fails, the service goes on
            if self.cancel_reason:
                outcome = self._cancelled()
            else:
                _log_failure(self.record.id, exc)
                self.log.system(f"job failed: {exc}")
                outcome = ("failed", None, f"{type(exc).__name__}: {exc}")
        finally:
            kept = self._kept(sandbox, outcome[0])
            debug = None if kept or sandbox is None else self._keep_for_debug(sandbox, outcome, config)
            if not kept and debug is None and sandbox is not None:
                _destroy(sandbox)
            self.finish(*(debug or outcome))
            if debug is not None and sandbox is not None:
                if self.on_kept is not None:
                    self.on_kept()
                self._hold_for_debug(sandbox)

    def _keep_for_debug(self, sandbox: SandboxLike, outcome: tuple[str, int | None, str | None],
                        config: ServiceConfig) -> tuple[str, int | None, str | None] | None:
        """A failed or timed-out job's VM, kept for the operator when the trusted side asks (docs/debugging.md):
        its network cut (unless the config says otherwise), the log and the result saying how long and how
        to attach. The outcome to finish with; None: destroy it as usual."""
        state, exit_code, error = outcome
        failed = state in ("failed", "timed_out") or (state == "finished" and exit_code != 0)
        if not failed or self.cancel_reason:
            return None
        if self.debug_seconds <= 0:
            refused = self.debug_refusal() if self.debug_refusal is not None else None
            if refused:
                self.log.system(refused)
            return None
        if not sandbox.alive:
            return None
        cut = config.debug.cut_network
        try:
            if cut:
                sandbox.cut_network()
        except Exception as exc:
            self.log.system(f"debug: the VM is not kept: its network could not be cut ({exc})")
            return None
        with self.lock:
            if self.cancel_reason:
                return None
            self.debug_until = time.time() + self.debug_seconds
        job = self.record.id
        until = time.strftime("%H:%M:%S UTC", time.gmtime(self.debug_until))
        note = (f"debug: VM {sandbox.id} is kept for {self.debug_seconds} s (until {until}), "
                f"{'its network cut to nothing' if cut else 'its network as the job had it'}: on the runner host, "
                f"`microvm-check jobs attach {job}` (the operator or the config's attach_group); "
                f"`microvm-check jobs cancel {job}` destroys it sooner")
        self.log.system(note)
        return state, exit_code, f"{error}; {note}" if error else note

    def _hold_for_debug(self, sandbox: SandboxLike) -> None:
        """Keep the VM (and so this job's worker) until its time is up, a cancel or its death; then destroy it."""
        try:
            while sandbox.alive and self.debug_until is not None:
                left = self.debug_until - time.time()
                if left <= 0 or self.debug_end.wait(min(left, 1.0)):
                    break
        finally:
            with self.lock:
                self.debug_until = None
            _destroy(sandbox)
            self.debug_gone.set()
            log.info("job %s: its VM %s kept for debugging is destroyed", self.record.id, sandbox.id)

    def _attach(self) -> SandboxLike | None:
        """The session's VM for this step; it is this step's alone until `_kept` hands it back."""
        assert self.session is not None
        self.update(state="starting")
        sandbox: SandboxLike | None
        with self.session.lock:
            sandbox, self.session.sandbox = self.session.sandbox, None
        if sandbox is None or not sandbox.alive:
            raise SessionGone(f"the job's kept VM is gone ({self.session.ended or 'it died'}); "
                              "run the job again")
        with self.lock:
            self.sandbox = sandbox
            cancelled = self.cancel_reason is not None
        if cancelled:
            return None
        self.update(vm_id=sandbox.id, vm_ready_at=time.time(), vm_ready_ms=0.0,
                    restored_from=RestoredFrom.of_manifest(sandbox.template_manifest, sandbox.accel))
        if self.checks is not None:
            self.checks.vm_started(self)
        self.log.system(f"step {self.session.steps} of the job, in its kept VM {sandbox.id} "
                        f"(session {self.session.id}); the checkout and earlier steps' files are there")
        return sandbox

    def _kept(self, sandbox: SandboxLike | None, state: str) -> bool:
        """After the step: hand a `keep: job` step's VM to its session when the step ended with a
        result; otherwise end the session (the caller destroys the VM). False: destroy it."""
        session, sessions = self.session, self.sessions
        if session is None or sessions is None:
            return False
        keep = self.spec.keep == "job" and state in ("finished", "timed_out") and not self.cancel_reason
        if keep and sandbox is not None and sandbox.alive:
            if session.hold(sandbox, time.monotonic()):
                self.log.system(f"VM {sandbox.id} kept for the job's next step (session {session.id})")
                return True
        why = "the job's last step ended" if self.spec.keep != "job" else f"step ended {state}"
        sessions.end(session, self.cancel_reason or why)
        if sandbox is not None:
            self.log.system(f"VM {sandbox.id} destroyed: the job's kept VM ends ({self.cancel_reason or why})")
        return False

    def _cancelled(self) -> tuple[str, int | None, str | None]:
        return "cancelled", EXIT_CANCELLED, self.cancel_reason

    def _run_in(self, sandbox: SandboxLike, config: ServiceConfig) -> tuple[str, int | None, str | None]:
        if not self.attached:
            self._put_checkout(sandbox)
        placeholders = self.secrets.bind(sandbox, self.policy, self.log)  # before the CA: it is made again to
        self.trust_env = {**sandbox.install_job_ca(), **placeholders}  # vouch for bound hosts; before any job code
        result = self._run_command(sandbox)
        self.secrets.note_uses(sandbox, self.policy, self.log, self.record)
        if self.cancel_reason:
            return self._cancelled()
        self._collect_artifacts(sandbox, config)
        blocked = bounded_blocked(sandbox.blocked_egress())
        with self.lock:
            self.record.blocked_egress = blocked
        if result.timed_out:
            timeout = f"the command ran longer than {self.spec.timeout_seconds} s"
            return "timed_out", EXIT_TIMEOUT, timeout
        exit_code = _exit_code(result.exit_code)
        return self._on_block(blocked, exit_code) or ("finished", exit_code, None)

    def _on_block(self, blocked: list[AuditRecord], exit_code: int | None) -> tuple[str, int | None, str | None] | None:
        """Under `on_block: fail`, a job whose guest had egress refused fails, its exit code kept."""
        refused = refused_egress(self.policy, blocked)
        if refused is None:
            return None
        self.log.system(f"egress was refused and the policy says on_block: fail: {refused}")
        return "failed", exit_code, f"egress refused (on_block: fail): {refused}"

    def _start_vm(self, create: SandboxFactory, config: ServiceConfig, choice: TemplateChoice) -> SandboxLike | None:
        self.update(state="starting")
        self.log.system(f"restoring from {choice.why}")
        begin = time.monotonic()
        sandbox = self.prewarmed
        if sandbox is not None and not sandbox.alive:
            self.log.system(f"the pre-warmed VM {sandbox.id} died while waiting; starting a fresh one")
            _destroy(sandbox)
            sandbox = self.prewarmed = None
            self.update(warm=False)
        if sandbox is None:
            ttl = self.spec.timeout_seconds + _TTL_MARGIN_SECONDS + self.debug_seconds
            sandbox = create(vm_request(config, choice,
                                        ttl_seconds=max(ttl, KEEP_MAX_SECONDS) if self.session is not None else ttl,
                                        policy=self.policy, job_id=self.record.id))
        with self.lock:
            self.sandbox = sandbox
            cancelled = self.cancel_reason is not None
        if cancelled:
            _destroy(sandbox)
            return None
        ready_ms = (time.monotonic() - begin) * 1000
        self.update(vm_id=sandbox.id, vm_ready_at=time.time(), vm_ready_ms=round(ready_ms, 3),
                    restored_from=RestoredFrom.of_manifest(sandbox.template_manifest, sandbox.accel))
        if self.checks is not None:
            self.checks.vm_started(self)
        self.log.system(f"VM {sandbox.id} ready in {ready_ms:.0f} ms{' (pre-warmed)' if self.prewarmed else ''}")
        return sandbox

    def _put_checkout(self, sandbox: SandboxLike) -> None:
        with open(self.checkout_path, "rb") as checkout:
            sandbox.put_tar(checkout, "/workspace")

    def command_env(self) -> dict[str, str]:
        """The environment of the job's command (and of a terminal attached to its VM)."""
        return {"CI": "true", **self.spec.env, **self.trust_env, "MICROVM_CHECK_JOB_ID": self.record.id}

    def _run_command(self, sandbox: SandboxLike) -> ExecResult:
        self.update(state="running", started_at=time.time())
        env = self.command_env()
        # with service containers, the command runs inside the script that starts and removes them
        command = containers.script(self.spec.services, self.spec.command) if self.spec.services else self.spec.command

        begun = time.monotonic()
        limit: float = self.spec.timeout_seconds

        masked = MaskedLog(self.log, self.secrets)

        def run(argv: list[str], timeout: float) -> ExecResult:
            try:
                return sandbox.exec(argv, timeout_seconds=timeout, env=env, cwd=self.spec.workdir,
                                    on_output=masked.append,
                                    capture_bytes=0)  # the job log has it all; another copy in memory helps no one
            finally:
                masked.flush()

        direct = direct_argv(command)  # no shell when it would only split words (runner/service/jobs/command.py)
        if direct is not None:
            try:
                return run(direct, limit)
            except CommandNotStarted:  # nothing of it ran (not found, not executable, no #!): the shell says
                if not sandbox.alive or self.cancel_reason:  # why, or runs it; any later failure is the job's
                    raise
            # the step has one deadline: the shell in the argv's place gets what is left of it
            limit = max(1.0, limit - (time.monotonic() - begun))
        return run(shell_argv(command), limit)

    def _collect_artifacts(self, sandbox: SandboxLike, config: ServiceConfig) -> None:
        """Validated artifacts into the job dir (runner/service/jobs/outputs.py); trouble with them is a
        warning in the log, and the command's exit code is the job's result either way."""
        entries = collect_artifacts(sandbox, self.spec, self.dir, self.dir / ARTIFACTS, config.artifacts, self.log,
                                    lambda: bool(self.cancel_reason))
        if entries is None:
            return
        with self.lock:
            self.record.artifacts = entries
        self.log.system(f"collected {len(entries)} artifact file(s)")


class SessionGone(JobError):
    """The kept VM a step was to attach to ended before the step started."""


def _exit_code(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -255 <= value <= 255:
        raise ValueError(f"the guest reported an impossible exit code {value!r}")
    return value


def _log_failure(job_id: str, exc: Exception) -> None:
    """An error of the project's tree says what to fix in one line (its traceback only at DEBUG, issue 27);
    anything else is a bug in the service, logged with its traceback."""
    if isinstance(exc, MicrovmCheckError):
        log.warning("job %s failed: %s", job_id, exc)
        log.debug("job %s failed", job_id, exc_info=True)
    else:
        log.warning("job %s failed", job_id, exc_info=True)


def _destroy(sandbox: SandboxLike) -> None:
    try:
        sandbox.destroy()
    except Exception:
        log.exception("destroying VM %s failed", sandbox.id)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
