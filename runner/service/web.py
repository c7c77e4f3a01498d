"""The read-only jobs page, served on the job API's TCP listener behind the same token.

Server-rendered with jinja2 (autoescape on for every template): it works without JavaScript; one small
script, served as a file of its own (a strict Content-Security-Policy allows no inline script), follows a
running job's log through /ui/jobs/<id>/logs, the job API's NDJSON log stream with each line in the
workflow-command-neutralised view the action prints (action.workflow.neutralise_line, stdlib only). The
script writes lines with textContent only, so a guest that prints HTML shows it as text.

Authentication is the TCP API's token: a bearer header, or once `?token=` which sets an HttpOnly,
SameSite=Strict cookie scoped to /ui and redirects to the same page without the token, so it stays out
of the address bar, the history and later request logs. The cookie is accepted on GET and HEAD of /ui
only: nothing it can reach changes state, so a forged cross-site request has nothing to do.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
import yaml

from action.workflow import neutralise_line, split_lines
from runner.jobapi.contract import LIST_MAX, LogEntry

COOKIE = "microvm_check_token"
PREFIX = "/ui"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'none'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store", "X-Frame-Options": "DENY"}
PAGE_LOG_LINES = 2000  # the server-rendered log shows the last lines; the script follows the rest
_SINCE_UNITS = {"d": 86400, "h": 3600}
_ENV = jinja2.Environment(loader=jinja2.PackageLoader("runner.service", "templates"),
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


def _when(epoch: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch)) if epoch else "-"


def _seconds(start: float | None, end: float | None) -> str:
    return f"{end - start:.1f} s" if start and end else "-"


_ENV.filters["when"] = _when
_ENV.globals["seconds"] = _seconds


def render(name: str, **context: Any) -> Page:
    return Page(200, _ENV.get_template(name).render(**context).encode())


def jobs_page(service: Any) -> Page:
    records = service.list(LIST_MAX)
    running = [r for r in records if not r.final]
    recent = [r for r in records if r.final]
    return render("jobs.html", running=running, recent=recent, health=service.health())


def job_page(service: Any, job_id: str) -> Page:
    record = service.get(job_id)
    lines, last_seq = _log_lines(service.log_of(job_id))
    return render("job.html", job=record, lines=lines, last_seq=last_seq, policy=_policy(service, record))


def insights_page(service: Any, repository: str, since: str) -> Page:
    from policy.suggest import JobAudit, merged_policy, record_from_json

    seconds = _since_seconds(since)
    records = service.records.of_repository(repository, time.time() - seconds) if repository else []
    jobs = [JobAudit(r.id, r.created_at, tuple(a for a in map(record_from_json, r.blocked_egress) if a))
            for r in records]
    suggestion = merged_policy(jobs, f"{repository}: {len(jobs)} jobs since {since}") if jobs else None
    return render("insights.html", repository=repository, since=since, jobs=len(jobs), suggestion=suggestion)


def _since_seconds(since: str) -> float:
    unit = _SINCE_UNITS.get(since[-1:], 0)
    return float(since[:-1]) * unit if unit and since[:-1].isdigit() and len(since) < 6 else 14 * 86400


def _log_lines(job_log: Any) -> tuple[list[dict[str, Any]], int]:
    """The log so far (never waiting for more), neutralised, the last PAGE_LOG_LINES of it."""
    lines: list[dict[str, Any]] = []
    seq = 0
    for raw in _committed(job_log):
        seq += 1
        entry = LogEntry.from_wire(json.loads(raw))
        lines.append({"stream": entry.stream, "text": neutral_text(entry.data)})
        del lines[:-PAGE_LOG_LINES]
    return lines, seq


def _committed(job_log: Any) -> Iterator[bytes]:
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


def _policy(service: Any, record: Any) -> dict[str, Any]:
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
