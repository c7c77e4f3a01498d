"""The service's own log: plain text or one JSON object per line, and one line per job lifecycle event.

Operators read the service log next to their other services', often through a collector that wants
JSON (`serve --log-format json`, or `log_format: json` in the config). Job events come from the job
records as they are saved (`JobEvents.saw`, called by `runner.service.jobs.records.RecordStore.put`):
every state change of a job is saved, so deriving the events there covers every path (API, worker,
reaper, start-up clean-up) without each of them having to remember to log. They go to the
`runner.jobs` logger at INFO, the service's default level, each with its job id as a field.

A job's record turns final only after its VM is destroyed (`runner.service.jobs.job.JobRun.execute`), so
its final record is also the "vm destroyed" event. Record fields may hold text a client or a guest
chose (repository, error text): JSON escapes it, and the text format escapes control characters, so
neither can forge a log line.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
EVENTS = logging.getLogger("runner.jobs")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, and an event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """The classic line, with control characters escaped: one record is always one line."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_CONTROL)  # a traceback after it keeps its lines


def setup(level: str = "warning", fmt: str = "text") -> None:
    """Send every log record to stderr at `level` (one of LEVELS) in format `fmt` (one of FORMATS)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _state(record: Any) -> str:
    return str(getattr(record.state, "value", record.state))


class JobEvents:
    """Turns each saved job record into the lifecycle events it is news of: submitted, queued, vm ready,
    started, vm destroyed and finished (with the exit code). Remembers each unfinished job's last record
    (a few small fields; forgotten when it ends)."""

    def __init__(self, kept: Callable[[str], bool] | None = None) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[str, str | None]] = {}  # job id -> (state, vm id)
        self.kept = kept  # whether a VM lives on for its job's next step (`keep: job`); set by the job service

    def saw(self, record: Any) -> None:
        state, vm_id = _state(record), record.vm_id
        with self._lock:
            previous = self._last.pop(record.id, None)
            if not record.final:
                self._last[record.id] = (state, vm_id)
        for event, message, fields in self._news(record, previous, state, vm_id):
            EVENTS.info(f"job {record.id} {message}", extra={"fields": {"event": event, "job_id": record.id, **fields}})

    def _news(self, record: Any, previous: tuple[str, str | None] | None, state: str,
              vm_id: str | None) -> list[tuple[str, str, dict[str, Any]]]:
        before_state, before_vm = previous or (None, None)
        news = []
        if previous is None and not record.final:
            news.append(("submitted", f"submitted: {record.repository}@{record.sha[:12]} {record.job_name}",
                         {"repository": record.repository, "sha": record.sha, "job_name": record.job_name,
                          "run_id": record.run_id, "run_attempt": record.run_attempt}))
        if state == "queued" and before_state != "queued":
            news.append(("queued", "queued", {}))
        if vm_id and vm_id != before_vm:
            ready = record.timings.vm_ready_ms
            news.append(("vm_ready", f"VM {vm_id} ready in {ready or 0:.0f} ms{' (pre-warmed)' if record.warm else ''}",
                         {"vm_id": vm_id, "vm_ready_ms": ready, "warm": record.warm}))
        if state == "running" and before_state != "running":
            news.append(("started", "started", {}))
        if record.final:
            if vm_id and self.kept is not None and self.kept(vm_id):
                news.append(("vm_kept", f"VM {vm_id} kept for the job's next step", {"vm_id": vm_id}))
            elif vm_id:
                news.append(("vm_destroyed", f"VM {vm_id} destroyed", {"vm_id": vm_id}))
            t = record.timings
            took = round(t.finished_at - t.started_at, 3) if t.finished_at and t.started_at else None
            code = "-" if record.exit_code is None else record.exit_code
            news.append(("finished", f"{state}: exit code {code}" + (f", {record.error}" if record.error else ""),
                         {"state": state, "exit_code": record.exit_code, "error": record.error, "seconds": took}))
        return news
