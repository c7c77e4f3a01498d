"""Job records in SQLite: the durable answer to "what ran, where, with which policy, and how did it end".

The record type and its states are the job API's contract (runner.jobapi.contract): what is stored
is what a client is answered. One connection guarded by a lock: the service writes from worker and
API threads, and SQLite's own locking across connections would only add busy-retry handling for no
gain in one process.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar

from microvm_check.entries import Artifact, AuditRecord
from runner.jobapi.contract import ACTIVE_STATES, FINAL_STATES, JobRecord, JobState, RestoredFrom, Timings
from runner.logs import JobEvents

_COLUMNS = (
    "id TEXT PRIMARY KEY",
    "state TEXT NOT NULL",
    "repository TEXT NOT NULL",
    "sha TEXT NOT NULL",
    "run_id INTEGER",
    "run_attempt INTEGER",
    "job_name TEXT NOT NULL",
    "created_at REAL NOT NULL",
    "vm_id TEXT",
    "policy_digest TEXT",
    "warm INTEGER NOT NULL",
    "exit_code INTEGER",
    "error TEXT",
    "queued_at REAL",
    "vm_ready_at REAL",
    "started_at REAL",
    "finished_at REAL",
    "vm_ready_ms REAL",
    "blocked_egress TEXT NOT NULL",
    "artifacts TEXT NOT NULL",
    "command TEXT NOT NULL DEFAULT ''",
    "narrowed_egress TEXT NOT NULL DEFAULT '[]'",
    "secrets_used TEXT NOT NULL DEFAULT '[]'",
    "terminal_sessions TEXT NOT NULL DEFAULT '[]'",
    "restored_from TEXT",
)
# Columns added since the first schema: a store made before gets them (ALTER TABLE) when opened.
_ADDED_COLUMNS = ("command TEXT NOT NULL DEFAULT ''", "narrowed_egress TEXT NOT NULL DEFAULT '[]'",
                  "secrets_used TEXT NOT NULL DEFAULT '[]'", "terminal_sessions TEXT NOT NULL DEFAULT '[]'",
                  "restored_from TEXT")
_NAMES = tuple(c.split()[0] for c in _COLUMNS)
_TIMING_NAMES = tuple(f.name for f in fields(Timings))

# What a column holds, as sqlite3 hands it over and takes it back.
SqlValue = str | int | float | None
Entry = TypeVar("Entry")


def _to_row(rec: JobRecord) -> tuple[SqlValue, ...]:
    values = asdict(rec)
    values.update(values.pop("timings"))
    values["state"] = rec.state.value
    values["warm"] = int(rec.warm)
    values["blocked_egress"] = json.dumps([entry.to_wire() for entry in rec.blocked_egress])
    values["artifacts"] = json.dumps([entry.to_wire() for entry in rec.artifacts])
    values["narrowed_egress"] = json.dumps(rec.narrowed_egress)
    values["secrets_used"] = json.dumps(rec.secrets_used)
    values["terminal_sessions"] = json.dumps(rec.terminal_sessions)
    values["restored_from"] = None if rec.restored_from is None else json.dumps(rec.restored_from.to_wire())
    return tuple(values[name] for name in _NAMES)


def _from_row(row: tuple[SqlValue, ...]) -> JobRecord:
    # Any: the columns are the record's own fields as _to_row wrote them, so each goes back to its field.
    values: dict[str, Any] = dict(zip(_NAMES, row, strict=True))
    timings = Timings(**{name: values.pop(name) for name in _TIMING_NAMES})
    values["warm"] = bool(values["warm"])
    values["blocked_egress"] = _entries(values["blocked_egress"], AuditRecord.from_wire)
    values["artifacts"] = _entries(values["artifacts"], Artifact.from_wire)
    values["narrowed_egress"] = json.loads(values["narrowed_egress"])
    values["secrets_used"] = json.loads(values["secrets_used"])
    values["terminal_sessions"] = json.loads(values["terminal_sessions"])
    restored = values["restored_from"]
    values["restored_from"] = None if restored is None else RestoredFrom.from_wire(json.loads(restored))
    return JobRecord(timings=timings, **values)


def _entries(column: str, read: Callable[[object], Entry | None]) -> list[Entry]:
    """A column of entries, each read back by its from_wire: the store's own, written checked."""
    return [entry for entry in map(read, json.loads(column)) if entry is not None]


class RecordEvents(Protocol):
    """Hears every record as it is saved: the lifecycle log (runner.logs), and the metrics beside it."""

    def saw(self, rec: JobRecord) -> None: ...


class RecordStore:
    def __init__(self, path: Path | str, kept: Callable[[str], bool] | None = None) -> None:
        """`kept`: whether a VM lives on for its job's next step (a session's), so its step's end says so."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"CREATE TABLE IF NOT EXISTS jobs ({', '.join(_COLUMNS)})")
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at)")
        have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column in _ADDED_COLUMNS:
            if column.split()[0] not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column}")
        self.events: RecordEvents = JobEvents(kept)  # the lifecycle log lines, from each record as it is saved (runner.logs)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def put(self, rec: JobRecord) -> None:
        marks = ", ".join("?" for _ in _NAMES)
        with self._lock:
            before = self._db.execute("SELECT state FROM jobs WHERE id = ?", (rec.id,)).fetchone()
            self._db.execute(f"INSERT OR REPLACE INTO jobs ({', '.join(_NAMES)}) VALUES ({marks})", _to_row(rec))
        if rec.final and before is not None and before[0] == rec.state.value:
            return  # a final record saved again (a terminal session's end, after the result) is no news
        self.events.saw(rec)

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(_NAMES)} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _from_row(row) if row else None

    def list(self, limit: int = 50) -> list[JobRecord]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_NAMES)} FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?", (limit,)
            ).fetchall()
        return [_from_row(r) for r in rows]

    def search(self, results: tuple[str, ...] = (), repository: str = "", limit: int = 50,
               offset: int = 0) -> tuple[builtins.list[JobRecord], int]:
        """A page of records, newest first, and how many match in all: `results` are states, or "success" /
        "failure" (a finished job's exit code), any of which matches; `repository` matches exactly."""
        where, args = [], []
        picked = []
        for result in results:
            if result == "success":
                picked.append("(state = 'finished' AND exit_code = 0)")
            elif result == "failure":
                picked.append("(state = 'finished' AND exit_code != 0)")
            else:
                picked.append("state = ?")
                args.append(result)
        if picked:
            where.append("(" + " OR ".join(picked) + ")")
        if repository:
            where.append("repository = ?")
            args.append(repository)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        with self._lock:
            total = self._db.execute(f"SELECT COUNT(*) FROM jobs{clause}", args).fetchone()[0]
            rows = self._db.execute(f"SELECT {', '.join(_NAMES)} FROM jobs{clause} ORDER BY created_at DESC, rowid DESC "
                                    "LIMIT ? OFFSET ?", (*args, limit, offset)).fetchall()
        return [_from_row(r) for r in rows], int(total)

    def in_states(self, states: tuple[JobState, ...]) -> Iterator[JobRecord]:
        marks = ", ".join("?" for _ in states)
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(_NAMES)} FROM jobs WHERE state IN ({marks})", states).fetchall()
        return iter([_from_row(r) for r in rows])

    def fail_unfinished(self, error: str, now: float | None = None) -> builtins.list[str]:
        """Mark every non-final job failed: called at start, when no job of ours can still be alive."""
        now = time.time() if now is None else now
        failed = []
        for rec in self.in_states(ACTIVE_STATES):
            rec.state = JobState.FAILED
            rec.error = error
            rec.timings.finished_at = now
            self.put(rec)
            failed.append(rec.id)
        return failed

    def prune(self, older_than: float, keep: int) -> builtins.list[str]:
        """Delete final records created before `older_than`, and any beyond the newest `keep`; returns their ids."""
        final = ", ".join("?" for _ in FINAL_STATES)
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM jobs WHERE state IN ({final}) AND (created_at < ? OR id NOT IN "
                f"(SELECT id FROM jobs ORDER BY created_at DESC, rowid DESC LIMIT ?))",
                (*FINAL_STATES, older_than, keep),
            ).fetchall()
            ids = [r[0] for r in rows]
            self._db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
        return ids

    def ids(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM jobs")}

    def of_repository(self, repository: str, since: float) -> builtins.list[JobRecord]:
        """`repository`'s jobs created at or after `since`, oldest first: the runs `policy suggest` merges."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(_NAMES)} FROM jobs WHERE repository = ? AND created_at >= ? "
                "ORDER BY created_at, rowid", (repository, since)).fetchall()
        return [_from_row(r) for r in rows]
