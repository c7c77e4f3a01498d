"""The `/github/webhook` endpoint: authenticated `workflow_job` events become job-service calls.

It listens on its own port (off unless configured) with `http.server`, because it takes one kind of
request and must refuse everything else cheaply: the method, content type and declared size are
checked before the body is read, the body is read only up to the limit, and the signature is
checked before anything in the body is believed. Rejections use one rule: 403 for a missing or
wrong signature (GitHub's documented validation answers 403 in both cases; there is no auth scheme
to challenge with, so 401 would be the wrong word), 405/411/413/415 for the request's form, 400 for
a signed body we cannot read. Anything signed and well-formed but uninteresting (other events,
unknown actions, jobs for other labels) gets 200 and is ignored, so GitHub does not mark it failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from runner.github import jobs, signature
from runner.github.deliveries import DeliveryLog
from runner.github.jobs import JobHooks

log = logging.getLogger(__name__)

WEBHOOK_PATH = "/github/webhook"
DEFAULT_MAX_BODY = 1024 * 1024
GUID_RE = re.compile(r"^[A-Za-z0-9-]{1,100}\Z")  # GitHub sends UUIDs
IGNORED_JOB_ACTIONS = frozenset({"in_progress", "waiting", "started"})  # "started" is no longer sent


@dataclass(frozen=True)
class WebhookConfig:
    secret: bytes
    labels: tuple[str, ...]
    max_body: int = DEFAULT_MAX_BODY
    max_concurrent: int = 16


@dataclass(frozen=True)
class Answer:
    status: int
    message: str
    close: bool = False  # the body was not read, so the connection cannot be reused


class WebhookReceiver:
    """Turns one HTTP request into an `Answer`, calling the job hooks for deliveries that matter."""

    def __init__(self, config: WebhookConfig, hooks: JobHooks, deliveries: DeliveryLog | None = None) -> None:
        self.config = config
        self.hooks = hooks
        self.deliveries = deliveries or DeliveryLog()

    def receive(self, method: str, path: str, headers: Mapping[str, str], read: Callable[[int], bytes]) -> Answer:
        early = self._check_form(method, path, headers)
        if early:
            return early
        body = read(int(headers["Content-Length"]))
        if not signature.verify(self.config.secret, body, headers.get("X-Hub-Signature-256")):
            why = "missing" if not headers.get("X-Hub-Signature-256") else "wrong"
            return Answer(403, f"X-Hub-Signature-256 is {why}: check the webhook secret shared with GitHub")
        guid = headers.get("X-GitHub-Delivery", "")
        if not GUID_RE.match(guid):
            return Answer(400, "X-GitHub-Delivery is missing or malformed")
        try:
            payload = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return Answer(400, "the body is not JSON")
        if not isinstance(payload, dict):
            return Answer(400, "the body is not a JSON object")
        # The signature covers the body but not the headers, so a captured delivery replayed under a
        # new GUID is caught by its body digest (GitHub never sends one body under two GUIDs).
        keys = (f"guid:{guid}", f"body:{hashlib.sha256(body).hexdigest()}")
        if not self.deliveries.claim_all(keys):
            return Answer(200, f"delivery {guid} was already processed")
        try:
            return self._dispatch(headers.get("X-GitHub-Event", "")[:64], payload)
        except Exception:
            self.deliveries.release_all(keys)  # let a redelivery try again
            log.exception("processing webhook delivery %s failed", guid)
            return Answer(500, f"processing delivery {guid} failed; see the service log")

    def _check_form(self, method: str, path: str, headers: Mapping[str, str]) -> Answer | None:
        if path.split("?", 1)[0] != WEBHOOK_PATH:
            return Answer(404, f"no such endpoint: webhooks go to {WEBHOOK_PATH}", close=True)
        if method != "POST":
            return Answer(405, "only POST is accepted here", close=True)
        content_type = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            return Answer(415, "set the webhook's content type to application/json", close=True)
        length = headers.get("Content-Length", "")
        # isdigit() alone also takes "²" and other Unicode digits, which int() then refuses
        if not (length.isascii() and length.isdigit()) or headers.get("Transfer-Encoding"):
            return Answer(411, "a Content-Length is required", close=True)
        if int(length) > self.config.max_body:
            return Answer(413, f"the body is larger than {self.config.max_body} bytes", close=True)
        return None

    def _dispatch(self, event: str, payload: dict[str, Any]) -> Answer:
        if event == "ping":
            return Answer(200, "pong")
        if event != "workflow_job":
            return Answer(200, f"ignored: event {event!r} is not used")
        action = payload.get("action")
        if action == "queued":
            return self._job_event(payload, action, jobs.queued_job, self.hooks.prewarm, "prewarming for job")
        if action == "completed":
            return self._job_event(payload, action, jobs.completed_job, self.hooks.job_completed, "completed: job")
        if action in IGNORED_JOB_ACTIONS:
            return Answer(200, f"ignored: workflow_job {action}")
        return Answer(200, f"ignored: unknown workflow_job action {str(action)[:50]!r}")

    def _job_event(self, payload: dict[str, Any], action: str, parse, hook, done: str) -> Answer:
        """Parse a workflow_job payload and hand it to `hook` when the job runs on our labels."""
        job = parse(payload)
        if job is None:
            return Answer(200, f"ignored: {action} job without a usable repository, ids or labels")
        if not jobs.is_ours(job.labels, self.config.labels):
            return Answer(200, "ignored: the job's labels are not ours")
        hook(job)
        return Answer(200, f"{done} {job.job_id}")


class _Handler(BaseHTTPRequestHandler):
    receiver: WebhookReceiver
    slots: threading.BoundedSemaphore
    timeout = 10  # a slow or stalled client cannot hold a thread for long
    server_version = "microvm-check-webhook"
    sys_version = ""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self._handle()

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    def do_PUT(self) -> None:  # noqa: N802
        self._handle()

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        if not self.slots.acquire(blocking=False):
            self._answer(Answer(503, "too many concurrent deliveries; GitHub can redeliver", close=True))
            return
        try:
            self._answer(self.receiver.receive(self.command, self.path, self.headers, self.rfile.read))
        except (OSError, ValueError):
            self.close_connection = True
        finally:
            self.slots.release()

    def _answer(self, answer: Answer) -> None:
        body = json.dumps({"message": answer.message}).encode()
        self.send_response(answer.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if answer.status == 405:
            self.send_header("Allow", "POST")
        if answer.close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("webhook %s: " + format, self.client_address[0], *args)


class WebhookServer:
    """The endpoint on its own thread; `port` is the bound port (useful when asked for port 0)."""

    def __init__(self, receiver: WebhookReceiver, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type(
            "WebhookHandler",
            (_Handler,),
            {"receiver": receiver, "slots": threading.BoundedSemaphore(receiver.config.max_concurrent)},
        )
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self, poll_interval: float = 0.5) -> None:
        """Serve on a thread; `poll_interval` is how long `stop()` may wait for it to notice."""
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, args=(poll_interval,), name="github-webhooks", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread:
            self._thread.join()

