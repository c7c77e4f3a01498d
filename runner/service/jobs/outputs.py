"""What a job's guest hands back besides its log, read as the hostile input it is: its artifacts and the
egress its policy refused.

Artifacts are fetched from the guest as one tar within a byte budget, validated member by member into the
clean tar the API serves (runner/tarsafe.py), and noted in the job's log. Files that break a rule (links,
devices, oversize, refused names) are skipped and named; the clean tar carries them as markers so the
action can name them too. A guest that breaks the transfer as a whole (its framing, the byte budget) ends
it: what was validated before stays. Blocked-egress records are bounded in number and size, and decide a
job's end only under `on_block: fail`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from pathlib import Path

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
                      log: JobLog, cancelled: Callable[[], bool]) -> list[dict[str, object]] | None:
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
              log: JobLog) -> list[dict[str, object]]:
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
    return [m.to_json() for m in copied.files]


def bounded_blocked(entries: Iterable[object] | None) -> list[dict[str, object]]:
    """Blocked-egress records as plain JSON, bounded: their content derives from guest traffic."""
    kept: list[dict[str, object]] = []
    for entry in list(entries or [])[:MAX_BLOCKED_RECORDS]:
        if hasattr(entry, "as_json"):  # runner.net.audit.AuditRecord
            entry = entry.as_json()
        elif dataclasses.is_dataclass(entry) and not isinstance(entry, type):
            entry = dataclasses.asdict(entry)
        if isinstance(entry, dict):
            kept.append({k: v for k, v in entry.items()
                         if isinstance(k, str) and (v is None or isinstance(v, (str, int, float))) and len(str(v)) <= 256})
    return kept


def refused_egress(policy: Policy | None, blocked: list[dict[str, object]]) -> str | None:
    """Under `on_block: fail`, what of the job's blocked egress its guest actually had refused, in one
    line (policy.suggest.refused_summary); None when the policy does not fail a job for it or none was."""
    if policy is None or policy.on_block != "fail":
        return None
    refused = suggest.refused([r for r in map(suggest.record_from_json, blocked) if r is not None], policy.mode)
    return suggest.refused_summary(refused) if refused else None
