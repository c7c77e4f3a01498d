"""Entry point of the GitHub action: `python -I -m action`, run by action.yml on the runner host.

One job, start to end: submit the JobSpec, stream the checkout, relay the logs live, fetch the record
and the artifacts, report (annotations, summary, outputs) and exit with the guest's exit code.
Cancelling the step (the runner sends SIGINT, then SIGTERM) cancels the job through the API first,
so the VM is destroyed instead of running on after the workflow gave up on it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TextIO

from action import session
from action.artifacts import ArtifactError, ArtifactLimits, BoundedWriter, Extraction, deliver
from action.attestation import write_envelope
from action.inputs import Inputs, debug_refusal, job_spec, read_inputs, runner_token
from action.junit import JUnitError, Totals, looks_like_junit, read_report
from action.logs import LogRelay
from action.queuewait import QueueWait
from action.summary import MAX_ANNOTATIONS, Result, exit_code_of, guest_annotation, markdown, minutes, outputs
from action.summary import annotations as failure_annotations  # `annotations` is the __future__ feature here
from runner.errors import MicrovmCheckError, UserError
from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import JobRecord, JobSpec, JobState, LogEntry
from runner.jobapi.pack import PackError, pack_checkout
from runner.jobapi.workflow import annotation, append_file, format_outputs, safe_text

LOG_RETRIES = 5  # consecutive log-stream failures without progress before the step gives up


class Interrupted(Exception):
    """The runner asked the step to stop (SIGINT/SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    # Only the first signal interrupts; later ones must not break the cancel and cleanup under way.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


class JobDriver:
    """Drives one job through a JobClient (runner/jobapi/client.py): the action's side of a job; the
    service's side is runner.service.jobs.job.JobRun."""

    api_errors = (JobAPIError, OSError)

    def __init__(self, client: JobClient, inputs: Inputs, workspace: Path, out: TextIO,
                 environ: Mapping[str, str]) -> None:
        self.client = client
        self.inputs = inputs
        self.workspace = workspace
        self.out = out
        self.environ = environ
        self.job_id: str | None = None
        self.artifact_trouble: list[str] = []  # why artifacts did not all come back (artifacts-required)
        self._ended: list[JobRecord] = []  # the records the log streams' end lines carried

    def run(self, spec: JobSpec) -> int:
        try:
            return self._run(spec)
        except Interrupted as exc:
            return self._cancel(exc)

    @property
    def _submitted_id(self) -> str:
        """The job's id, for the steps after the submit: `job_id` is None only before it answered."""
        assert self.job_id is not None, "no job submitted yet"
        return self.job_id

    def _run(self, spec: JobSpec) -> int:
        waiting = QueueWait(self.inputs.timeout_minutes, say=self._say)  # a full queue: wait, up to the timeout
        self.client.session_token = session.read(self.environ)  # a `keep: job` VM an earlier step opened
        summary = waiting.submit(self.client, spec)
        self.job_id = summary.id
        warning = session.after_submit(self.environ, spec.keep, summary)
        if warning:
            self.out.write(annotation("warning", warning) + "\n")
        dropped, record = self._relay_logs(self._send_checkout(summary.state))
        extraction = self._artifacts()
        junit = self._junit(extraction)
        result = Result(record=record, exit_code=self._exit_code(record, extraction), junit=junit,
                        artifacts=extraction.files, refused_artifacts=extraction.skipped,
                        log_dropped_bytes=dropped)
        self._report(result)
        self._attestation()
        return result.exit_code

    def _attestation(self) -> None:
        """The job's signed record next to its artifacts (action/attestation.py); its path is the `attestation`
        output. Without one (an older service, a failed signature) the step says so and its result stands."""
        job_id = self._submitted_id
        temp = self.environ.get("RUNNER_TEMP")
        try:
            data = self.client.attestation(job_id)
            path = write_envelope(data, self.workspace, self.inputs.artifacts_path if self.inputs.artifacts else None,
                                  Path(temp) if temp else None, job_id)
        except (*self.api_errors, MicrovmCheckError) as exc:
            self.out.write(annotation("warning", f"the job's signed record was not written: {exc}") + "\n")
            return
        self._say(f"signed job record: {path} (check it with `microvm-check verify`)")
        append_file("GITHUB_OUTPUT", format_outputs({"attestation": str(path)}), self.environ)

    def _send_checkout(self, state: JobState) -> Iterator[LogEntry] | None:
        """Pack and upload the workspace in the request that answers the job's log stream (`PUT .../checkout
        ?follow=1`, as `run` does): the logs come on the upload's own connection, no request of their own.
        Answers that stream, or None when the job attached to a VM an earlier step of this GitHub job kept
        (`keep: job`): the service queues such a job at once (the submit's answer says so), the checkout
        is in its VM. A refused upload raises here, before any log is relayed."""
        job_id = self._submitted_id
        if state != JobState.AWAITING_CHECKOUT:
            self._say(f"job {job_id} submitted; it runs in the VM an earlier step of this job kept")
            return None
        self._say(f"job {job_id} submitted; packing {self.workspace}")
        try:
            chunks = pack_checkout(self.workspace, include_git=self.inputs.include_git)
            return self.client.upload_and_follow(job_id, chunks, on_end=self._ended.append)
        except PackError as exc:
            raise UserError(f"checkout refused: {exc}") from exc

    def _relay_logs(self, stream: Iterator[LogEntry] | None) -> tuple[int, JobRecord]:
        """Relay `stream` (the upload's answer; None: open one) until the job ends; a dropped stream resumes
        after the last sequence number seen. Answers the bytes the relay dropped and the job's final record
        (the one the stream ended with, when final).

        Only failures in a row without progress count against LOG_RETRIES: new entries reset the
        count, and a read timeout on a job that is still running is a job that prints nothing for
        a while, which is normal (the stream has no keep-alives), not a lost stream.
        """
        job_id = self._submitted_id
        after, failures = 0, 0
        last_error: Exception | None = None
        ended = self._ended
        title = f"microvm-check: {self.inputs.run.strip().splitlines()[0][:100]}"
        with LogRelay(self.out, title) as relay:
            while True:
                before, timed_out = after, False
                try:
                    if stream is None:
                        stream = self.client.logs(job_id, after=after, on_end=ended.append)
                    for entry in stream:
                        relay.feed(entry.stream, entry.data)
                        after = max(after, entry.seq)
                except self.api_errors as exc:
                    last_error, timed_out = exc, _is_timeout(exc)
                stream = None
                record = ended[-1] if ended and ended[-1].final else self.client.get(job_id)
                if record.final:
                    return relay.dropped_bytes, record
                if after > before:
                    failures = 0
                if timed_out:
                    continue  # the service answered get() just now: the job is alive, only silent
                failures += 1
                if failures > LOG_RETRIES:
                    why = last_error or "it keeps ending before the job does"
                    raise UserError(f"lost the log stream of job {self.job_id}: {why}")
                time.sleep(1)

    def _artifacts(self) -> Extraction:
        """The artifacts, in a new directory of the workspace (see action/artifacts.py); trouble is a warning."""
        if not self.inputs.artifacts:
            return Extraction()
        limits = ArtifactLimits()
        temp = self.environ.get("RUNNER_TEMP") or None
        with tempfile.TemporaryFile(dir=temp) as spool:
            try:
                self.client.artifacts(self._submitted_id, BoundedWriter(spool, limits.max_total_bytes + 64 * 1024 * 1024))
                spool.seek(0)
                return deliver(spool, self.workspace, self.inputs.artifacts_path, self.inputs.artifacts,
                               Path(temp) if temp else None, limits)
            except self.api_errors as exc:
                if getattr(exc, "status", None) == 404:  # nothing matched: the record says why
                    self.artifact_trouble.append("no file matched the artifact globs")
                    return Extraction()
                self._artifact_warning(f"artifacts not copied: {exc}")
            except ArtifactError as exc:
                self._artifact_warning(f"artifacts: {exc}")
        return Extraction()

    def _artifact_warning(self, text: str) -> None:
        self.artifact_trouble.append(text)
        self.out.write(annotation("warning", text) + "\n")

    def _exit_code(self, record: JobRecord, extraction: Extraction) -> int:
        """The command's exit code; with artifacts-required, 1 instead of 0 when artifacts are missing."""
        code = exit_code_of(record)
        trouble = self.artifact_trouble + [f"{name}: {why}" for name, why in extraction.skipped]
        if self.inputs.artifacts and not extraction.files and not trouble:
            trouble.append("no artifact came back")
        if code == 0 and self.inputs.artifacts_required and trouble:
            self.out.write(annotation("error", f"artifacts-required: {len(trouble)} problem(s) with the artifacts, "
                                               f"first: {trouble[0]}") + "\n")
            return 1
        return code

    def _artifact_dir(self) -> Path:
        return self.workspace / self.inputs.artifacts_path

    def _junit(self, extraction: Extraction) -> Totals | None:
        totals: Totals | None = None
        if not extraction.files:
            return totals
        dest = self._artifact_dir()
        for artifact in extraction.files:
            path = dest / artifact.path
            if not artifact.path.endswith(".xml") or not looks_like_junit(path):
                continue
            try:
                report = read_report(path)
            except JUnitError as exc:
                self.out.write(guest_annotation("warning", f"JUnit report {artifact.path}: {exc}") + "\n")
                continue
            totals = totals or Totals()
            totals.add(report)
        return totals

    def _report(self, result: Result) -> None:
        record = result.record
        prefix = "" if self.inputs.working_directory == "." else self.inputs.working_directory.rstrip("/") + "/"
        for line in failure_annotations(result.junit.failures if result.junit else [], prefix):
            self.out.write(line + "\n")
        if record.state == JobState.TIMED_OUT:
            self.out.write(annotation("error", f"job timed out after {minutes(self.inputs.timeout_minutes)}") + "\n")
        elif record.error:
            self.out.write(guest_annotation("error", f"job {record.state.value}: {record.error}") + "\n")
        elif result.exit_code:
            self.out.write(annotation("error", f"command exited with {result.exit_code}") + "\n")
        self._refused_warnings(result.refused_artifacts)
        self.out.flush()
        append_file("GITHUB_STEP_SUMMARY", markdown(result), self.environ)
        append_file("GITHUB_OUTPUT", format_outputs(outputs(result)), self.environ)

    def _refused_warnings(self, refused: list[tuple[str, str]]) -> None:
        """One warning per refused artifact up to GitHub's per-step limit, then a count: the guest
        decides how many there are (up to the service's max_count), so the lines must not scale with it."""
        for name, why in refused[:MAX_ANNOTATIONS]:
            self.out.write(guest_annotation("warning", f"artifact {name} not copied: {why}") + "\n")
        if len(refused) > MAX_ANNOTATIONS:
            self.out.write(annotation("warning", f"{len(refused) - MAX_ANNOTATIONS} more artifacts not copied "
                                                 "(the result-json output lists them all)") + "\n")

    def _cancel(self, exc: Interrupted) -> int:
        self._say(f"{exc}: cancelling job {self.job_id or '(not submitted yet)'}")
        if self.job_id is not None:
            try:
                self.client.cancel(self.job_id)
            except self.api_errors as cancel_exc:  # the step ends either way; say why the VM may linger
                self.out.write(annotation("warning", f"could not cancel job {self.job_id}: {cancel_exc}") + "\n")
        append_file("GITHUB_OUTPUT", format_outputs({"exit-code": str(128 + exc.signum)}), self.environ)
        self.out.flush()
        return 128 + exc.signum

    def _say(self, text: str) -> None:
        self.out.write(f"[microvm-check] {safe_text(text)}\n")
        self.out.flush()


def _is_timeout(exc: BaseException) -> bool:
    """Whether the service stopped answering within the client's timeout (a silent job, for a log stream)."""
    return isinstance(exc, JobAPIError) and exc.timed_out or isinstance(exc, TimeoutError)


class _SafeFormatter(logging.Formatter):
    """Log records can carry checkout file names: print them so they cannot form workflow commands."""

    def format(self, record: logging.LogRecord) -> str:
        return safe_text(super().format(record))


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_SafeFormatter("[microvm-check] %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


def _abandon(job: JobDriver | None, out: TextIO) -> None:
    """Cancel a job this step submitted but can no longer follow, so its VM does not run on."""
    if job is None or job.job_id is None:
        return
    try:
        job.client.cancel(job.job_id)
    except job.api_errors as exc:
        out.write(annotation("warning", f"could not cancel job {job.job_id}: {exc}") + "\n")


def main(environ: Mapping[str, str] = os.environ, out: TextIO = sys.stdout) -> int:
    _setup_logging()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    job: JobDriver | None = None
    client: JobClient | None = None
    try:
        inputs = read_inputs(environ)
        refused = debug_refusal(environ)
        if refused:
            out.write(annotation("warning", refused) + "\n")
        workspace = Path(environ.get("GITHUB_WORKSPACE") or os.getcwd())
        spec = job_spec(inputs, environ, workspace)
        # a busy service (503) is waited out by the client; a full queue (429) by QueueWait, which says how full
        client = JobClient(socket=inputs.socket, runner_token=runner_token(environ), retry_statuses=frozenset({503}),
                           retry_seconds=inputs.timeout_minutes * 60, keep_alive=True)
        job = JobDriver(client, inputs, workspace, out, environ)
        client.say = job._say  # the client's one progress line goes to the job log
        return job.run(spec)
    except Interrupted as exc:
        return 128 + exc.signum
    except (MicrovmCheckError, OSError) as exc:  # raised on purpose with a complete message (runner/errors.py)
        out.write(annotation("error", f"microvm-check: {exc}") + "\n")
        _abandon(job, out)
        return 1
    except Exception:  # a bug: report it without letting guest-derived text in it act as a command
        out.write(safe_text(traceback.format_exc()) + "\n")
        out.write(annotation("error", "microvm-check: internal error (traceback above)") + "\n")
        _abandon(job, out)
        return 1
    finally:
        if client is not None:
            client.close()


if __name__ == "__main__":
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8", errors="replace")
    sys.exit(main())
