"""The check run lists the job's secret bindings (issue 35): names, hosts, where each came from and how
many requests its value went into, in a section of its own after the signed record's digests, which a
guest's egress attempts or findings cannot push out; never a value (the record has none to give)."""

from __future__ import annotations

from microvm_check.entries import AuditRecord
from runner.github.checks import MAX_SUMMARY, Finding, JobOutcome, summary

USED = ({"name": "index", "host": "idx.test", "source": "operator", "requests": 3},
        {"name": "npm", "host": "npm.internal.example", "source": "workflow", "requests": 0})


def outcome(**changes: object) -> JobOutcome:
    fields: dict[str, object] = dict(
        job_id="j1", state="finished", exit_code=0, duration_s=1.0, vm_ready_ms=10.0, junit=None, findings=(),
        blocked_egress=(), mode="block", digests={"policy": "sha256:" + "a" * 64}, secrets_used=USED)
    fields.update(changes)
    return JobOutcome(**fields)  # type: ignore[arg-type]


def test_the_summary_lists_the_bindings_used_after_the_digests() -> None:
    text = summary(outcome())
    assert "#### Secret bindings" in text
    assert "| index | idx.test | operator | 3 |" in text and "| npm | npm.internal.example | workflow | 0 |" in text
    assert text.index("#### Signed record") < text.index("#### Secret bindings") < text.index("#### Egress")


def test_a_guest_that_floods_egress_and_findings_cannot_push_the_bindings_out() -> None:
    flood = tuple(AuditRecord(f"10.0.{n // 250}.{n % 250}", 443, "tcp", f"h{n}.example" * 5, 1, "policy")
                  for n in range(5000))
    findings = tuple(Finding("failure", "x" * 3000, "t") for _ in range(500))
    text = summary(outcome(blocked_egress=flood, findings=findings))
    assert len(text.encode()) <= MAX_SUMMARY
    assert "| index | idx.test | operator | 3 |" in text


def test_a_job_without_bindings_has_no_such_section() -> None:
    assert "Secret bindings" not in summary(outcome(secrets_used=()))
