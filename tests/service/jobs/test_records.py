"""SQLite job records: round trip, restart recovery, retention."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from microvm_check.entries import Artifact, AuditRecord
from runner.jobapi.contract import ImageUsed, RestoredFrom, TemplateRef
from runner.service.jobs.records import _COLUMNS, _NAMES, JobRecord, RecordStore


def record(job_id: str, state: str = "finished", created_at: float = 1000.0) -> JobRecord:
    rec = JobRecord(id=job_id, state=state, repository="octo/hello", sha="a" * 40, run_id=5,
                    run_attempt=1, job_name="test", created_at=created_at)
    return rec


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "db")
    rec = record("j1")
    rec.vm_id, rec.warm, rec.exit_code, rec.policy_digest = "vm-1", True, 3, "sha256:ab"
    rec.timings.queued_at, rec.timings.vm_ready_ms = 1.5, 0.25
    rec.blocked_egress = [AuditRecord("192.0.2.1", 443, "tcp", None, 1)]
    rec.artifacts = [Artifact("a.txt", 3)]
    rec.restored_from = RestoredFrom(TemplateRef("node20", "d1"), TemplateRef("node20--net--o--r", "d2"),
                                     ImageUsed("docker://127.0.0.1:5000/node@sha256:" + "c" * 64, "sha256:" + "d" * 64), "tcg")
    store.put(rec)
    again = RecordStore(tmp_path / "db").get("j1")
    assert again == rec
    assert store.get("nope") is None


def test_a_store_from_before_restored_from_gets_its_column_and_its_records_read_none(tmp_path: Path) -> None:
    old_columns = [c for c in _COLUMNS if not c.startswith("restored_from ")]
    db = sqlite3.connect(str(tmp_path / "db"))
    db.execute(f"CREATE TABLE jobs ({', '.join(old_columns)})")
    row = {name: None for name in _NAMES if name != "restored_from"}
    row.update(id="j1", state="finished", repository="o/r", sha="a" * 40, job_name="t", created_at=1.0, warm=0,
               blocked_egress="[]", artifacts="[]", command="", narrowed_egress="[]", secrets_used="[]",
               terminal_sessions="[]")
    db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))
    db.commit()
    db.close()
    store = RecordStore(tmp_path / "db")
    old = store.get("j1")
    assert old is not None and old.restored_from is None
    old.restored_from = RestoredFrom(TemplateRef("base", "d1"), accelerator="kvm")
    store.put(old)
    assert store.get("j1") == old


def test_list_is_newest_first_and_limited(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "db")
    for i in range(5):
        store.put(record(f"j{i}", created_at=1000.0 + i))
    assert [r.id for r in store.list(3)] == ["j4", "j3", "j2"]


def test_unfinished_jobs_fail_at_restart(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "db")
    for state in ("awaiting_checkout", "queued", "starting", "running", "finished", "cancelled"):
        store.put(record(state, state=state))
    failed = store.fail_unfinished("the service died", now=2000.0)
    assert sorted(failed) == ["awaiting_checkout", "queued", "running", "starting"]
    running = store.get("running")
    assert (running.state, running.error, running.timings.finished_at) == ("failed", "the service died", 2000.0)
    assert store.get("finished").state == "finished"


def test_prune_by_age_and_count_spares_active_jobs(tmp_path: Path) -> None:
    store = RecordStore(tmp_path / "db")
    store.put(record("old", created_at=10.0))
    store.put(record("old-running", state="running", created_at=10.0))
    for i in range(4):
        store.put(record(f"new{i}", created_at=100.0 + i))
    pruned = store.prune(older_than=50.0, keep=3)
    assert sorted(pruned) == ["new0", "old"]
    assert store.ids() == {"old-running", "new1", "new2", "new3"}
