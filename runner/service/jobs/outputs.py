"""What a job's guest hands back besides its log, read as the hostile input it is: its artifacts and the
egress its policy refused.

Artifacts are fetched from the guest as one tar within a byte budget, validated member by member into the
clean tar the API serves (runner/tarsafe.py), and noted in the job's log. Files that break a rule (links,
devices, oversize, refused names) are skipped and named; the clean tar carries them as markers so the
action can name them too. A guest that breaks the transfer as a whole (its framing, the byte budget) ends
it: what was validated before stays. Blocked-egress records are bounded in number and held to the rules a
reader holds them to (`AuditRecord.checked`), and decide a job's end only under `on_block: fail`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from microvm_check.entries import Artifact, AuditRecord
from policy import suggest
from policy.model import Policy
from runner.jobapi.contract import JobSpec
from runner.sandbox.port import SandboxLike
from runner.service.config.settings import ArtifactLimits
from runner.service.jobs.joblog import JobLog
from runner.tarsafe import Limits, copy_validated

MAX_ARTIFACT_NOTES = 50  # log notes about skipped artifacts; they are outside the guest's log budget
MAX_BLOCKED_RECORDS = 1000


def collect_artifacts(sandbox: SandboxLike, spec: JobSpec, job_dir: Path, clean: Path, limits: ArtifactLimits,
                      log: JobLog, cancelled: Callable[[], bool]) -> list[Artifact] | None:
    """The validated artifacts' entries for the job's record (the caller notes how many were collected),
    their clean tar at `clean`; None when the spec asks for none or nothing matched. Trouble with them is
    a warning in the log: the command's exit code is the job's result either way. A transfer that fails
    because the job was cancelled raises."""
    if not spec.artifacts:
        return None
    raw = job_dir / "artifacts.raw"
    # Headers and padding take at most 1.5 KiB a member plus the end blocks.
    budget = limits.max_total_bytes + 1536 * (limits.max_count + 2) + 10240
    stopped: str | None = None
    try:
        with open(raw, "wb") as out:
            size = sandbox.get_tar(list(spec.artifacts), out, budget, cwd=spec.workdir)
        if size == 0:
            log.system(f"no files matched the artifact patterns {', '.join(spec.artifacts)}")
            return None
    except Exception as exc:  # the guest failed or broke the transfer: keep what arrived intact
        if cancelled():
            raw.unlink(missing_ok=True)
            raise
        stopped = f"the guest's artifact transfer failed: {exc}"
    try:
        return _validate(raw, clean, limits, stopped, spec.artifacts, log)
    finally:
        raw.unlink(missing_ok=True)


def _validate(raw: Path, clean: Path, limits: ArtifactLimits, stopped: str | None, patterns: tuple[str, ...],
              log: JobLog) -> list[Artifact]:
    tar_limits = Limits(max_files=limits.max_count, max_file_bytes=limits.max_total_bytes,
                        max_total_bytes=limits.max_total_bytes)
    with open(raw, "rb") as src, open(f"{clean}.part", "wb") as dst:
        copied = copy_validated(src, dst, tar_limits, stopped=stopped, stop_names=patterns)
    os.replace(f"{clean}.part", clean)
    for name, why in copied.skipped[:MAX_ARTIFACT_NOTES]:
        log.system(f"warning: artifact {name} skipped: {why}")
    if len(copied.skipped) > MAX_ARTIFACT_NOTES:  # the guest chose how many; the clean tar names each
        log.system(f"warning: {len(copied.skipped) - MAX_ARTIFACT_NOTES} more artifacts skipped "
                   "(the artifact tar carries a note for each)")
    if copied.stopped:
        log.system(f"warning: artifact transfer ended early: {copied.stopped}")
    return copied.files


def bounded_blocked(records: Iterable[AuditRecord]) -> list[AuditRecord]:
    """What the sandbox's audit saw, for the job's record: at most MAX_BLOCKED_RECORDS, each as a reader
    will read it (their names and paths derive from guest traffic); a record that breaks the rules is left out."""
    kept = (record.checked() for record in list(records)[:MAX_BLOCKED_RECORDS])
    return [record for record in kept if record is not None]


def refused_egress(policy: Policy | None, blocked: list[AuditRecord]) -> str | None:
    """Under `on_block: fail`, what of the job's blocked egress its guest actually had refused, in one
    line (policy.suggest.refused_summary); None when the policy does not fail a job for it or none was."""
    if policy is None or policy.on_block != "fail":
        return None
    refused = suggest.refused(blocked, policy.mode)
    return suggest.refused_summary(refused) if refused else None
