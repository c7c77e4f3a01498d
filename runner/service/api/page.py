"""The read-only jobs page, served on the job API's TCP listener behind the same token.

Server-rendered with jinja2 (autoescape on for every template): it works without JavaScript; one small
script, served as a file of its own (a strict Content-Security-Policy allows no inline script), follows a
running job's log through /ui/jobs/<id>/logs, the job API's NDJSON log stream with each line in the
workflow-command-neutralised view the action prints (runner.jobapi.workflow.neutralise_line, stdlib only). The
script writes lines with textContent only, so a guest that prints HTML shows it as text.

Authentication is the TCP API's token: a bearer header, or once `?token=` which sets an HttpOnly,
SameSite=Strict cookie scoped to /ui and redirects to the same page without the token, so it stays out
of the address bar, the history and later request logs. The cookie is accepted on GET and HEAD of /ui,
and on one POST: a job's cancel button, whose form carries a CSRF token (an HMAC of the job id under the
service's token) that a page of another site cannot know; nothing else the cookie reaches changes state.

The list refreshes itself with `<meta http-equiv="refresh">` while jobs are active (no script at all);
a job page shows the last PAGE_LOG_LINES lines of the log, numbered with anchors and timestamped, with
the whole log as a download (log.txt) and a server-side search (`?q=`) over all of it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict
from urllib.parse import parse_qs, urlencode

import jinja2
import yaml

from runner.jobapi.contract import JobRecord, LogEntry, step_exit_code
from runner.jobapi.workflow import neutralise_line, split_lines
from runner.service.jobs.joblog import ShownLine, shown_lines

if TYPE_CHECKING:
    from runner.service.jobs.joblog import JobLog
    from runner.service.jobs.service import JobService

COOKIE = "microvm_check_token"
PREFIX = "/ui"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'none'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
# same-origin, not no-referrer: with no-referrer a browser sends `Origin: null` on the cancel form's POST, and the
# origin check could not tell the page's own form from a sandboxed frame; other sites still get no referrer.
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
           "Cache-Control": "no-store", "X-Frame-Options": "DENY"}
PAGE_LOG_LINES = 2000  # the server-rendered log shows the last lines; the script follows the rest
PAGE_TRANSCRIPT_LINES = 2000  # the terminal transcript shows its last lines; terminal.txt has it all
PAGE_JOBS = 50  # jobs per page of the list
REFRESH_SECONDS = 10  # the list reloads itself this often while any job is active
MAX_SEARCH_HITS = 2000
MAX_FORM = 4096  # the cancel form: one CSRF token
# The list's filter: a final state, "success"/"failure" (a finished job's exit code), or "active".
RESULT_FILTERS = ("success", "failure", "failed", "timed_out", "cancelled", "active")
ACTIVE = ("awaiting_checkout", "queued", "starting", "running")
_UI_JOB = re.compile(r"/ui/jobs/(?P<id>[A-Za-z0-9_-]{1,64})(?P<rest>/logs|/artifacts|/cancel|/log\.txt|/terminal\.txt)?")
GITHUB = "https://github.com"
_SINCE_UNITS = {"d": 86400, "h": 3600}
_ENV = jinja2.Environment(loader=jinja2.PackageLoader("runner.service.api", "templates"),
                          autoescape=True, undefined=jinja2.StrictUndefined)


def cookie_token(cookie_header: str) -> str | None:
    """The token from a Cookie header, if it carries ours."""
    for part in cookie_header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


def query_token(target: str) -> str | None:
    _, _, query = target.partition("?")
    values = parse_qs(query).get("token")
    return values[-1] if values else None


def without_token(path: str, query: dict[str, list[str]]) -> str:
    """The page's own address without `token`: where `?token=` redirects."""
    rest = {k: v for k, v in query.items() if k != "token"}
    return path + ("?" + urlencode(rest, doseq=True) if rest else "")


def set_cookie(token: str) -> str:
    return f"{COOKIE}={token}; Path={PREFIX}; HttpOnly; SameSite=Strict"


@dataclass(frozen=True)
class Page:
    status: int
    body: bytes
    content_type: str = "text/html; charset=utf-8"


def ui_job_route(path: str) -> tuple[str, str] | None:
    """(job id, "" or "/logs", "/artifacts", "/cancel", "/log.txt", "/terminal.txt") for a job's page path,
    else None."""
    match = _UI_JOB.fullmatch(path)
    return (match.group("id"), match.group("rest") or "") if match else None


def csrf_token(secret: str, job_id: str) -> str:
    """The cancel form's token: only a page the service rendered (for someone with its token) holds it."""
    return hmac.new(secret.encode(), f"cancel:{job_id}".encode(), hashlib.sha256).hexdigest()


def csrf_ok(secret: str, job_id: str, form: bytes) -> bool:
    offered = parse_qs(form.decode("ascii", "replace")).get("csrf", [""])[-1]
    return hmac.compare_digest(offered.encode(), csrf_token(secret, job_id).encode())


def result_of(job: JobRecord) -> str:
    """The colour and icon class of a job: success/failure for a finished command (its step exit code,
    decided as the action decides it), else its state."""
    state = str(job.state)
    if state == "finished":
        return "success" if step_exit_code(job.state, job.exit_code) == 0 else "failure"
    return state


RESULT_ICONS = {"success": "✓", "failure": "✗", "failed": "⚠", "timed_out": "⏱", "cancelled": "⊘",
                "running": "▶", "starting": "…", "queued": "…", "awaiting_checkout": "…"}


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch)) if epoch else "-"


def _seconds(start: float | None, end: float | None) -> str:
    return f"{end - start:.1f} s" if start and end else "-"


def _clock(epoch: float | None) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(epoch)) + f".{int((epoch or 0) * 1000) % 1000:03d}" if epoch else ""


def _duration(job: JobRecord) -> str:
    t = job.timings
    end = t.finished_at or (time.time() if t.started_at else None)
    if not t.started_at or not end:
        return "-"
    took = end - t.started_at
    text = f"{took:.1f} s" if took < 120 else f"{int(took // 60)} min {int(took % 60)} s"
    return text if t.finished_at else text + " so far"


def github_run(job: JobRecord) -> str | None:
    """The job's workflow run on GitHub, when the job came from one (a run id and an owner/name repository)."""
    if not job.run_id or job.repository.count("/") != 1:
        return None
    attempt = f"/attempts/{job.run_attempt}" if job.run_attempt else ""
    return f"{GITHUB}/{job.repository}/actions/runs/{job.run_id}{attempt}"


_ENV.filters["when"] = _when
_ENV.filters["clock"] = _clock
_ENV.globals["seconds"] = _seconds
_ENV.globals["duration"] = _duration
_ENV.globals["result_of"] = result_of
_ENV.globals["icons"] = RESULT_ICONS
_ENV.globals["github_run"] = github_run


def render(name: str, **context: object) -> Page:
    return Page(200, _ENV.get_template(name).render(**context).encode())


@dataclass(frozen=True)
class ListQuery:
    """The list's filters and page, from the address (bounded: nothing from it reaches SQL but as values)."""

    result: str = ""
    repository: str = ""
    page: int = 1
    refresh: bool = True

    @classmethod
    def from_query(cls, query: dict[str, list[str]]) -> ListQuery:
        result = query.get("state", [""])[-1]
        page = query.get("page", ["1"])[-1]
        return cls(result if result in RESULT_FILTERS else "", query.get("repository", [""])[-1].strip()[:200],
                   int(page) if page.isdigit() and 0 < len(page) < 6 else 1, query.get("refresh", ["1"])[-1] != "0")

    def address(self, **change: object) -> str:
        values = {"state": self.result, "repository": self.repository, "page": self.page,
                  "refresh": "" if self.refresh else "0", **change}
        kept = {k: v for k, v in values.items() if v not in ("", None) and not (k == "page" and v == 1)}
        return PREFIX + ("?" + urlencode(kept) if kept else "")


def jobs_page(service: JobService, query: ListQuery | None = None) -> Page:
    query = query or ListQuery()
    results = ACTIVE if query.result == "active" else (query.result,) if query.result else ()
    jobs, total = service.records.search(results, query.repository, PAGE_JOBS, (query.page - 1) * PAGE_JOBS)
    pages = max(1, -(-total // PAGE_JOBS))
    health = service.health()
    refresh = query.refresh and (health.running or health.queued or any(not j.final for j in jobs))
    return render("jobs.html", jobs=jobs, total=total, query=query, pages=pages, health=health,
                  refresh=REFRESH_SECONDS if refresh else None, filters=RESULT_FILTERS)


def job_page(service: JobService, job_id: str, secret: str = "", search: str = "") -> Page:
    from policy.suggest import narrowed_words

    record = service.get(job_id)
    lines, last_seq, total = _log_lines(service.log_of(job_id), search[:200])
    started = record.timings.started_at or record.created_at
    transcript, transcript_total = _transcript_tail(service.config.jobs_dir / record.id)
    return render("job.html", job=record, blocked=record.blocked_egress, lines=lines,
                  last_seq=last_seq, total_lines=total, search=search[:200],
                  started=started, policy=_policy(service, record), csrf=csrf_token(secret, job_id) if secret else "",
                  narrowed=narrowed_words(record.narrowed_egress),
                  tail=PAGE_LOG_LINES if total > len(lines) and not search else None,
                  transcript=transcript, transcript_total=transcript_total)


def insights_page(service: JobService, repository: str, since: str) -> Page:
    from policy.suggest import JobAudit, merged_policy

    seconds = _since_seconds(since)
    records = service.records.of_repository(repository, time.time() - seconds) if repository else []
    jobs = [JobAudit(r.id, r.created_at, tuple(r.blocked_egress)) for r in records]
    suggestion = merged_policy(jobs, f"{repository}: {len(jobs)} jobs since {since}") if jobs else None
    return render("insights.html", repository=repository, since=since, jobs=len(jobs), suggestion=suggestion)


def _since_seconds(since: str) -> float:
    unit = _SINCE_UNITS.get(since[-1:], 0)
    return float(since[:-1]) * unit if unit and since[:-1].isdigit() and len(since) < 6 else 14 * 86400


class PageLine(TypedDict):
    """One numbered line of the job page's log."""

    n: int
    stream: str
    ts: float
    text: str


class PolicyView(TypedDict):
    """The job page's policy section: the repository's policy now (or why it does not load), and whether
    the job ran under it."""

    text: str | None
    error: str | None
    same: bool
    digest: NotRequired[str]

def _log_lines(job_log: JobLog, search: str = "") -> tuple[list[PageLine], int, int]:
    """The log so far (never waiting for more), neutralised, as numbered lines: the last PAGE_LOG_LINES of
    it, or with `search` the lines (of all) that contain it. Returns them, the last seq and the line count."""
    lines: list[PageLine] = []
    needle = search.casefold()
    number = 0
    entries = _Entries(_committed(job_log))
    for stream, ts, text in _lines_of(entries):
        number += 1
        if needle and (needle not in text.casefold() or len(lines) >= MAX_SEARCH_HITS):
            continue
        lines.append({"n": number, "stream": stream, "ts": ts, "text": text})
        if not needle and len(lines) > 2 * PAGE_LOG_LINES:
            del lines[:-PAGE_LOG_LINES]
    if not needle:
        del lines[:-PAGE_LOG_LINES]
    return lines, entries.seq, number


class _Entries:
    """The log's entries, counting them (the seq the page's script follows on from)."""

    def __init__(self, raw: Iterator[bytes]) -> None:
        self._raw, self.seq = raw, 0

    def __iter__(self) -> Iterator[LogEntry]:
        for line in self._raw:
            self.seq += 1
            yield LogEntry.from_wire(json.loads(line))


def _lines_of(entries: Iterable[LogEntry]) -> Iterator[tuple[str, float, str]]:
    """(stream, time, text) per line: output arrives in pieces that split lines anywhere, so a piece that
    ends inside a line is continued by the next piece of the same stream (another stream ends it)."""
    pending: tuple[str, float, str] | None = None
    for entry in entries:
        text = neutral_text(entry.data)
        first = entry.ts  # when the first of its lines began
        if pending is not None:
            if pending[0] == entry.stream and entry.stream != "system":
                text, first = pending[2] + text, pending[1]
            else:
                yield pending
            pending = None
        parts = text.split("\n")
        for i, part in enumerate(parts[:-1]):
            yield entry.stream, first if i == 0 else entry.ts, part
        if parts[-1]:
            ts = first if len(parts) == 1 else entry.ts
            if entry.stream == "system":
                yield entry.stream, ts, parts[-1]  # a note is a whole line
            else:
                pending = (entry.stream, ts, parts[-1])
    if pending is not None:
        yield pending


def log_text(job_log: JobLog) -> Iterator[bytes]:
    """The whole log as text, each line with its time and stream (log.txt), neutralised like the page."""
    for stream, ts, text in _lines_of(_Entries(_committed(job_log))):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts * 1000) % 1000:03d}Z"
        yield f"{stamp} {stream:<6} {text}\n".encode()


def _transcript_tail(job_dir: Path) -> tuple[list[ShownLine], int]:
    """The last PAGE_TRANSCRIPT_LINES lines of the job's terminal transcript (neutralised), and how many."""
    lines: list[ShownLine] = []
    total = 0
    for line in shown_lines(job_dir):
        total += 1
        lines.append(line)
        if len(lines) > 2 * PAGE_TRANSCRIPT_LINES:
            del lines[:-PAGE_TRANSCRIPT_LINES]
    return lines[-PAGE_TRANSCRIPT_LINES:], total


def transcript_text(job_dir: Path) -> Iterator[bytes]:
    """The whole terminal transcript as inert text (terminal.txt): each line with its time, session and
    direction; no escape sequence or control of the guest's reaches whoever prints it."""
    for line in shown_lines(job_dir):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(line.ts)) + f".{int(line.ts * 1000) % 1000:03d}Z"
        yield f"{stamp} #{line.session} {line.dir:<4} {line.text}\n".encode()


def _committed(job_log: JobLog) -> Iterator[bytes]:
    """The lines written so far: read the log file up to its last newline, never following it."""
    path = Path(job_log.path)
    if not path.exists():
        return iter(())
    data = path.read_bytes()
    return iter(data[: data.rfind(b"\n") + 1].splitlines())


def neutral_text(data: bytes) -> str:
    """Guest output as the action shows it: decoded with replacement, each line neutralised."""
    return "\n".join(neutralise_line(line) for line in split_lines(data.decode("utf-8", "replace")))


def neutral_log_line(raw: bytes) -> bytes:
    """One NDJSON log line with its data in the neutralised view (same shape as the API's)."""
    entry = LogEntry.from_wire(json.loads(raw))
    data = neutral_text(entry.data).encode()
    return json.dumps({**entry.to_wire(), "data": base64.b64encode(data).decode()}).encode() + b"\n"


def _policy(service: JobService, record: JobRecord) -> PolicyView:
    """The repository's effective policy now, and whether it is the one the job ran under (same digest)."""
    try:
        current = service.policies.effective(record.repository, None)
    except Exception as exc:
        return {"text": None, "error": str(exc)[:500], "same": False}
    text = yaml.safe_dump(current.canonical(), sort_keys=False)
    return {"text": text, "error": None, "same": current.digest() == record.policy_digest,
            "digest": current.digest()}


STATIC = PREFIX + "/static/"
_STATIC_TYPES = {"log.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


def static(name: str) -> Page | None:
    """One of the page's own files (a fixed list: no path from the request reaches the file system)."""
    content_type = _STATIC_TYPES.get(name)
    if content_type is None:
        return None
    return Page(200, (Path(__file__).parent / "templates" / name).read_bytes(), content_type)
