"""The pull request's check run for each job (runner/github/checks.py), posted as the GitHub App.

One background thread posts them in order (the start before the end of the same job), so GitHub's
latency or an outage never holds a job or its worker: a failed post is logged and the job's result is
unchanged. A final update GitHub refuses as invalid (422) is sent again, short, by `CheckRuns.complete`,
so a body GitHub will not take never leaves a check run in progress. Whether a repository gets check
runs is its trusted store file's `checks:` (on, off, forks; off when unset), read when the VM starts.
A job whose check run was never created gets none at its end.

What the check run says is the service's own account, the same as the signed record's (the artifacts'
sha256 and JUnit totals from `ArtifactFacts`, the policy and egress-audit digests, the key id), plus
annotations from the JUnit failures and the `::error`/`::warning`/`::notice` lines of the job's stdout.
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from policy import PolicyStore
from runner.attest.statement import rfc3339
from runner.github.checks import CheckRuns, JobOutcome, failure_findings, output_findings
from runner.service.jobs.attestation import audit_digest

if TYPE_CHECKING:
    from runner.service.jobs.job import JobRun

log = logging.getLogger(__name__)

MAX_LOG_SCAN_BYTES = 16 * 1024 * 1024  # of the job's log file read for `::error` lines
MAX_PENDING = 1000  # posts waiting; past it new ones are dropped (logged): GitHub is down or slow
_STOP = object()


class CheckRunReporter:
    """Posts each job's check run from one thread; `close` lets what is queued go out first."""

    def __init__(self, checks: Callable[[], CheckRuns], store: PolicyStore, public_url: str | None = None,
                 keyid: str | None = None) -> None:
        self._checks = checks  # made at the first post: the App's client is built only when needed
        self._client: CheckRuns | None = None
        self.store = store
        self.public_url = public_url.rstrip("/") if public_url else None
        self.keyid = keyid
        self._ids: dict[str, int] = {}  # job id -> check run id
        self._queue: queue.Queue[object] = queue.Queue(MAX_PENDING)
        self._thread = threading.Thread(target=self._post_all, name="check-runs", daemon=True)
        self._thread.start()

    def wanted(self, run: JobRun) -> bool:
        """Whether the job's repository asks for check runs (and a fork's job, with `forks`)."""
        if not run.spec.sha or run.spec.event == "local":
            return False
        try:
            setting = self.store.checks_for(run.spec.repository)
        except Exception:  # a broken store file: its jobs fail at admission anyway; post nothing
            log.warning("job %s: the checks setting of %s could not be read", run.record.id, run.spec.repository,
                        exc_info=True)
            return False
        return setting == "on" or (setting == "forks" and run.spec.fork)

    def vm_started(self, run: JobRun) -> None:
        if self.wanted(run):
            self._put(("start", run))

    def job_ended(self, run: JobRun) -> None:
        self._put(("end", run))

    def close(self, timeout: float = 30.0) -> None:
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def details_url(self, job_id: str) -> str | None:
        return f"{self.public_url}/ui/jobs/{job_id}" if self.public_url else None

    def _put(self, item: tuple[str, JobRun]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            log.warning("job %s: check run update dropped: %d posts are waiting for GitHub", item[1].record.id,
                        MAX_PENDING)

    def _post_all(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            assert isinstance(item, tuple)
            kind, run = item
            try:
                self._start(run) if kind == "start" else self._end(run)
            except Exception:  # GitHub down, a refused payload: the job's result stands
                log.warning("job %s: posting its check run (%s) failed", run.record.id, kind, exc_info=True)

    def _api(self) -> CheckRuns:
        if self._client is None:
            self._client = self._checks()
        return self._client

    def _start(self, run: JobRun) -> None:
        record = run.record
        name = f"microvm-check / {run.spec.job_name}" if run.spec.job_name else "microvm-check"
        self._ids[record.id] = self._api().start(record.repository, record.sha, name, record.id,
                                                 rfc3339(record.timings.vm_ready_at), self.details_url(record.id))

    def _end(self, run: JobRun) -> None:
        check_id = self._ids.pop(run.record.id, None)
        if check_id is None:
            return
        record = run.record
        self._api().complete(record.repository, check_id, outcome(run, self.keyid), rfc3339(record.timings.finished_at))


def outcome(run: JobRun, keyid: str | None = None) -> JobOutcome:
    """The ended job as the check run shows it: from the record and the facts the signed record holds."""
    record, facts = run.record, run.artifact_facts
    t = record.timings
    junit = facts.junit if facts is not None else None
    findings = failure_findings(junit.failures if junit else [],
                                "" if run.spec.working_directory in ("", ".") else run.spec.working_directory.strip("/") + "/")
    findings += output_findings(stdout_lines(run.dir / "log.ndjson"))
    digests = {"policy": record.policy_digest or "–", "egress audit": audit_digest(record)}
    if keyid:
        digests["signing key"] = keyid
    return JobOutcome(
        job_id=record.id, state=record.state.value, exit_code=record.exit_code,
        duration_s=(t.finished_at - t.started_at) if t.finished_at and t.started_at else None,
        vm_ready_ms=t.vm_ready_ms, junit=(junit.passed, junit.failed, junit.skipped) if junit else None,
        findings=tuple(findings), blocked_egress=tuple(record.blocked_egress),
        mode=run.policy.mode if run.policy is not None else "block", digests=digests,
        artifacts=facts.subjects if facts else (), error=record.error,
        secrets_used=tuple(record.secrets_used),
        restored_from=None if record.restored_from is None else record.restored_from.describe())


def stdout_lines(path: Path) -> Iterator[str]:
    """The job's stdout as text lines, from its NDJSON log, at most MAX_LOG_SCAN_BYTES of it."""
    pending, scanned = b"", 0
    try:
        with path.open("rb") as handle:
            for raw in handle:
                scanned += len(raw)
                if scanned > MAX_LOG_SCAN_BYTES:
                    break
                try:
                    entry = json.loads(raw)
                    data = base64.b64decode(entry["data"]) if entry.get("stream") == "stdout" else b""
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    yield line[:8192].decode("utf-8", "replace")
                pending = pending[-8192:]
    except OSError:
        return
    if pending:
        yield pending.decode("utf-8", "replace")
