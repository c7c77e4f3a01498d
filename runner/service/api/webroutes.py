"""The metrics and the read-only jobs page (runner/service/api/page.py) on the job API's TCP listener only,
behind its token: a bearer header, or the page's cookie on GET and HEAD of /ui and on a job's cancel
button, whose form also carries its CSRF token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from runner.jobapi.contract import MAX_LOG_SEQ
from runner.service.api import metrics, page
from runner.service.api.jobroutes import JobRoutes, LogStream, int_param
from runner.service.api.metrics import JobMetrics
from runner.service.api.refusals import MethodNotAllowed, NoRoute
from runner.service.jobs.admission import TooLarge
from runner.service.jobs.auth import Forbidden

if TYPE_CHECKING:
    from runner.service.api.exchange import Exchange


def answer(ex: Exchange, params: Mapping[str, str]) -> None:
    """/metrics and the page under /ui, on the TCP listener (runner/service/api/paths.py)."""
    WebRoutes(ex).answer(ex.method, params["path"], ex.query)


class WebRoutes:
    """Answers one request for the page or the metrics (the TCP listener's only)."""

    def __init__(self, exchange: Exchange) -> None:
        self.h = exchange

    def _token(self) -> str:
        """The TCP listener's token: it also keys the page's CSRF tokens (page.csrf_token)."""
        token = self.h.listener.token
        assert token is not None  # the path table sends only the TCP listener's requests here
        return token

    def _metrics(self) -> JobMetrics:
        registry = self.h.listener.metrics
        assert registry is not None  # the TCP listener always has its registry
        return registry

    def answer(self, method: str, path: str, query: dict[str, list[str]]) -> None:
        h, token = self.h, self._token()
        ui = page.ui_job_route(path)
        if method == "POST" and ui is not None and ui[1] == "/cancel":
            return self._cancel(ui[0])
        if method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{method} is not allowed on {path}: only a job's cancel button posts")
        if path == "/metrics":
            return h.respond(200, self._metrics().exposition(), {"Content-Type": metrics.CONTENT_TYPE})
        offered = query.get("token")
        if offered:  # the gate checked it: trade it for a cookie, and drop it from the address (and our log)
            h.path = page.without_token(path, query)
            return h.respond(303, b"", {"Location": h.path, "Set-Cookie": page.set_cookie(offered[-1]),
                                        **page.HEADERS})
        if path.startswith(page.STATIC):
            return self._static(path[len(page.STATIC):])
        if ui is not None:
            job_id, rest = ui
            if rest == "/logs":
                return self._logs(job_id, int_param(query, "after", 0, 0, MAX_LOG_SEQ))
            if rest == "/artifacts":
                download = f'attachment; filename="{job_id}-artifacts.tar"'
                return JobRoutes(h).artifacts(job_id, {"Content-Disposition": download, **page.HEADERS})
            if rest == "/log.txt":
                return self._log_text(job_id)
            if rest == "/terminal.txt":
                return self._transcript_text(job_id)
            if rest == "/cancel":
                raise MethodNotAllowed(f"GET is not allowed on {path}: the job page's cancel button posts")
            shown = page.job_page(h.service, job_id, token, query.get("q", [""])[-1])
        elif path in (page.PREFIX, page.PREFIX + "/"):
            shown = page.jobs_page(h.service, page.ListQuery.from_query(query))
        elif path == page.PREFIX + "/insights":
            shown = page.insights_page(h.service, query.get("repository", [""])[-1][:200],
                                     query.get("since", ["14d"])[-1][:8])
        else:
            raise NoRoute(f"no page {path}; the jobs are at {page.PREFIX}")
        h.respond(shown.status, shown.body, {"Content-Type": shown.content_type, **page.HEADERS})

    def _cancel(self, job_id: str) -> None:
        """The job page's cancel button: a same-origin form with the page's CSRF token, then back to the page."""
        h = self.h
        form = bytearray()
        for chunk in h.body():
            form += chunk
            if len(form) > page.MAX_FORM:
                h.close_connection = True
                raise TooLarge(f"the form is larger than {page.MAX_FORM} bytes")
        origin = h.headers.get("Origin")
        if origin is not None and origin != f"http://{h.headers.get('Host', '')}":
            raise Forbidden(f"a cancel from another origin ({origin[:100]}) is refused")
        if not page.csrf_ok(self._token(), job_id, bytes(form)):
            raise Forbidden("the form's CSRF token is missing or wrong: reload the job page and press cancel again")
        h.service.cancel(job_id, "cancelled from the jobs page")
        h.respond(303, b"", {"Location": f"{page.PREFIX}/jobs/{job_id}", **page.HEADERS})

    def _log_text(self, job_id: str) -> None:
        h = self.h
        job_log = h.service.log_of(job_id)
        h.start_response(200, {"Content-Type": "text/plain; charset=utf-8",
                               "Content-Disposition": f'attachment; filename="{job_id}.log.txt"', **page.HEADERS})
        for data in page.log_text(job_log):
            h.send_data(data)
        h.end_response()

    def _transcript_text(self, job_id: str) -> None:
        """The job's terminal transcript, neutralised as the page shows it."""
        h = self.h
        record = h.service.get(job_id)  # 404 for unknown ids
        h.start_response(200, {"Content-Type": "text/plain; charset=utf-8",
                               "Content-Disposition": f'attachment; filename="{record.id}.terminal.txt"',
                               **page.HEADERS})
        for data in page.transcript_text(h.service.config.jobs_dir / record.id):
            h.send_data(data)
        h.end_response()

    def _static(self, name: str) -> None:
        asset = page.static(name)
        if asset is None:
            raise NoRoute(f"no file {name!r} under {page.STATIC}")
        self.h.respond(200, asset.body, {"Content-Type": asset.content_type, **page.HEADERS})

    def _logs(self, job_id: str, after: int) -> None:
        """The job API's log stream with each line in the neutralised view the action prints."""
        stream = LogStream(self.h.service.log_of(job_id).cursor(after), lambda: JobRoutes(self.h).end_line(job_id),
                           page.neutral_log_line, heartbeat=False)  # a browser has no read timeout to feed
        self.h.start_response(200, {"Content-Type": "application/x-ndjson", **page.HEADERS})
        self.h.hand_off(stream)
