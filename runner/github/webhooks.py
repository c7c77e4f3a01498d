"""The `/github/webhook` endpoint: authenticated `workflow_job` and `push` events become job-service calls.

It listens on its own port (off unless configured) through `runner.httpserve` (h11 reads the
HTTP/1.1), because it takes one kind of request from the internet and must refuse everything else
cheaply: the method, path, content type, declared size and the form of the signature header are
checked on the head alone; only then is the body read, by the connection loop under an overall
deadline, and only a complete body takes one of the `max_concurrent` delivery workers, which check
the signature before anything in the body is believed. Rejections use one rule: 403 for a missing or
wrong signature (GitHub's documented validation answers 403 in both cases; there is no auth scheme
to challenge with, so 401 would be the wrong word), 405/411/413/415 for the request's form, 400 for
framing that cannot be read (an invalid Content-Length, RFC 9112 6.3) and for a signed body we cannot
read. Anything signed and well-formed but uninteresting (other events, unknown actions, jobs for other
labels) gets 200 and is ignored, so GitHub does not mark it failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import Any, Protocol, TypeVar, overload

from runner import jsonbody
from runner.github import jobs, signature
from runner.httpserve import BoundedHTTPServer, Head, ServerLimits, Refusal, ServedRequest, listen_tcp, parse_decimal
from runner.github.deliveries import DeliveryLog
from runner.github.jobs import CompletedJob, InProgressJob, JobHooks, QueuedJob

log = logging.getLogger(__name__)
IpNetwork = IPv4Network | IPv6Network

WEBHOOK_PATH = "/github/webhook"
DEFAULT_MAX_BODY = 256 * 1024  # GitHub's workflow_job deliveries are ~10-30 KB, push deliveries rarely 100 KB
# Before its signature is checked a delivery is a stranger's: per source, at most this many bodies and
# this many of max_body's bytes are read at once (the slowest give way), and after BODY_GRACE seconds a
# body must keep up BODY_MIN_RATE all along, which GitHub, sending a delivery in one go, always does.
PEER_BODIES, PEER_BODY_FACTOR, PEER_CONNECTIONS = 8, 8, 64
BODY_GRACE, BODY_MIN_RATE = 2.0, 64 * 1024
GUID_RE = re.compile(r"^[A-Za-z0-9-]{1,100}\Z")  # GitHub sends UUIDs
SIGNATURE_RE = re.compile(r"sha256=[0-9a-f]{64}\Z")
IGNORED_JOB_ACTIONS = frozenset({"waiting", "started"})  # "started" is no longer sent
# A delivery's result, as counted by `WebhookReceiver.counts`: acted on; signed but of no interest; already
# processed (a redelivery or a replay); refused for its form (path, method, type, size) or unreadable when
# signed; its signature missing, malformed or wrong; failed in our hooks (500).
ACCEPTED, IGNORED, DUPLICATE, REFUSED, MALFORMED, BAD_SIGNATURE, FAILED = (
    "accepted", "ignored", "duplicate", "refused", "malformed", "bad_signature", "failed")
# The event label of the counts: the X-GitHub-Event header is sent before any signature is checked, so
# only the events we read are named; anything else is "other", so a stranger cannot grow the label set.
COUNTED_EVENTS = frozenset({"workflow_job", "push", "ping"})


@dataclass(frozen=True)
class WebhookConfig:
    secret: bytes
    labels: tuple[str, ...]
    max_body: int = DEFAULT_MAX_BODY
    max_concurrent: int = 16  # deliveries processed at once (worker threads)
    max_connections: int = 512  # open connections, most of them still sending; the oldest give way
    allow_sources: tuple[IpNetwork, ...] = ()  # only these source networks are served (empty: any)


@dataclass(frozen=True)
class Answer:
    status: int
    message: str
    result: str  # ACCEPTED, IGNORED, ...: what the delivery is counted as
    close: bool = False  # the body was not read, so the connection cannot be reused


class Headers(Protocol):
    """A request's headers as the receiver reads them: the server's case-insensitive HTTPMessage
    (whose get() gives the first of repeated headers), or a plain dict."""

    @overload
    def get(self, name: str, /) -> str | None: ...

    @overload
    def get(self, name: str, default: str, /) -> str: ...


_Job = TypeVar("_Job", QueuedJob, InProgressJob, CompletedJob)


class WebhookReceiver:
    """Turns one HTTP request into an `Answer`, calling the job hooks for deliveries that matter."""

    def __init__(self, config: WebhookConfig, hooks: JobHooks, deliveries: DeliveryLog | None = None) -> None:
        self.config = config
        self.hooks = hooks
        self.deliveries = deliveries or DeliveryLog()
        self._counts: dict[tuple[str, str], int] = {}
        self._counts_lock = threading.Lock()

    def counts(self) -> dict[tuple[str, str], int]:
        """Requests answered since start, by (event, result): a copy, for the service's metrics."""
        with self._counts_lock:
            return dict(self._counts)

    def _count(self, headers: Headers, answer: Answer) -> Answer:
        event = headers.get("X-GitHub-Event", "")
        key = (event if event in COUNTED_EVENTS else "other", answer.result)
        with self._counts_lock:
            self._counts[key] = self._counts.get(key, 0) + 1
        return answer

    def deliver(self, headers: Headers, body: bytes) -> Answer:
        """A whole body whose head passed `check_form`: check its signature, then act on it."""
        return self._count(headers, self._deliver(headers, body))

    def _deliver(self, headers: Headers, body: bytes) -> Answer:
        if not signature.verify(self.config.secret, body, headers.get("X-Hub-Signature-256")):
            return Answer(403, "X-Hub-Signature-256 is wrong: check the webhook secret shared with GitHub",
                          BAD_SIGNATURE)
        guid = headers.get("X-GitHub-Delivery", "")
        if not GUID_RE.match(guid):
            return Answer(400, "X-GitHub-Delivery is missing or malformed", MALFORMED)
        try:
            payload = jsonbody.loads(body)
        except jsonbody.JsonBodyError as exc:
            return Answer(400, f"the body is not JSON: {exc}", MALFORMED)
        if not isinstance(payload, dict):
            return Answer(400, "the body is not a JSON object", MALFORMED)
        # The signature covers the body but not the headers, so a captured delivery replayed under a
        # new GUID is caught by its body digest (GitHub never sends one body under two GUIDs).
        keys = (f"guid:{guid}", f"body:{hashlib.sha256(body).hexdigest()}")
        if not self.deliveries.claim_all(keys):
            return Answer(200, f"delivery {guid} was already processed", DUPLICATE)
        try:
            return self._dispatch(headers.get("X-GitHub-Event", "")[:64], payload)
        except Exception:
            self.deliveries.release_all(keys)  # let a redelivery try again
            log.exception("processing webhook delivery %s failed", guid)
            return Answer(500, f"processing delivery {guid} failed; see the service log", FAILED)

    def check_form(self, method: str, path: str, headers: Headers) -> Answer | None:
        """The checks a head alone allows, made before the body is read: None when it may be sent."""
        answer = self._check_form(method, path, headers)
        return None if answer is None else self._count(headers, answer)

    def _check_form(self, method: str, path: str, headers: Headers) -> Answer | None:
        if path.split("?", 1)[0] != WEBHOOK_PATH:
            return Answer(404, f"no such endpoint: webhooks go to {WEBHOOK_PATH}", REFUSED, close=True)
        if method != "POST":
            return Answer(405, "only POST is accepted here", REFUSED, close=True)
        content_type = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            return Answer(415, "set the webhook's content type to application/json", REFUSED, close=True)
        declared = headers.get("Content-Length", "").strip()
        length = parse_decimal(declared)
        if length is None and declared.isascii() and declared.isdigit():
            length = self.config.max_body + 1  # more digits than parse_decimal takes: a huge body, not a missing length
        if length is None or headers.get("Transfer-Encoding"):
            return Answer(411, "a Content-Length is required", REFUSED, close=True)
        if length > self.config.max_body:
            return Answer(413, f"the body is larger than {self.config.max_body} bytes", REFUSED, close=True)
        offered = headers.get("X-Hub-Signature-256")
        if not offered or not SIGNATURE_RE.match(offered):
            why = "missing" if not offered else "malformed"
            return Answer(403, f"X-Hub-Signature-256 is {why}: check the webhook secret shared with GitHub",
                          BAD_SIGNATURE, close=True)
        return None

    def _dispatch(self, event: str, payload: dict[str, Any]) -> Answer:
        if event == "ping":
            return Answer(200, "pong", ACCEPTED)
        if event == "push":
            return self._push(payload)
        if event != "workflow_job":
            return Answer(200, f"ignored: event {event!r} is not used", IGNORED)
        action = payload.get("action")
        if action is not None and not isinstance(action, str):  # [] once reached a frozenset lookup: a 500
            return Answer(400, f"workflow_job action: expected a string, got {type(action).__name__}", MALFORMED)
        if action == "queued":
            return self._job_event(payload, action, jobs.queued_job, self.hooks.prewarm, "prewarming for job")
        if action == "in_progress":
            return self._job_event(payload, action, jobs.in_progress_job, self.hooks.job_in_progress,
                                   "in progress: job")
        if action == "completed":
            return self._job_event(payload, action, jobs.completed_job, self.hooks.job_completed, "completed: job")
        if action in IGNORED_JOB_ACTIONS:
            return Answer(200, f"ignored: workflow_job {action}", IGNORED)
        return Answer(200, f"ignored: unknown workflow_job action {str(action)[:50]!r}", IGNORED)

    def _job_event(self, payload: dict[str, Any], action: str, parse: Callable[[Mapping[str, Any]], _Job | None],
                   hook: Callable[[_Job], None], done: str) -> Answer:
        """Parse a workflow_job payload and hand it to `hook` when the job runs on our labels."""
        job = parse(payload)
        if job is None:
            return Answer(200, f"ignored: {action} job without a usable repository, ids or labels", IGNORED)
        if not jobs.is_ours(job.labels, self.config.labels):
            return Answer(200, "ignored: the job's labels are not ours", IGNORED)
        hook(job)
        return Answer(200, f"{done} {job.job_id}", ACCEPTED)

    def _push(self, payload: dict[str, Any]) -> Answer:
        """A push to the default branch makes the repository's warm bases stale; other pushes are ignored."""
        push = jobs.default_branch_push(payload)
        if push is None:
            return Answer(200, "ignored: not a push of a commit to the repository's default branch", IGNORED)
        self.hooks.default_branch_pushed(push)
        return Answer(200, f"default branch of {push.repository} at {push.after[:12]}: its warm bases are rebuilt",
                      ACCEPTED)


class _Handler(ServedRequest):
    """Runs on a delivery worker, with the whole body already read by the connection loop."""

    server: "_Server"

    def do_POST(self) -> None:  # noqa: N802 (ServedRequest's do_<METHOD> naming)
        answer = self.server.receiver.deliver(self.headers, b"".join(self.body()))
        self.close_connection = answer.close
        self.respond(answer.status, _message_body(answer.message), {"Content-Type": "application/json"})


class _Server(BoundedHTTPServer):
    def __init__(self, receiver: WebhookReceiver, host: str, port: int) -> None:
        self.receiver = receiver
        config = receiver.config
        limits = ServerLimits(max_connections=config.max_connections, max_workers=config.max_concurrent,
                        buffer_body_max=config.max_body, body_seconds=BODY_GRACE, body_min_rate=BODY_MIN_RATE,
                        max_per_peer=PEER_CONNECTIONS, max_bodies_per_peer=PEER_BODIES,
                        max_body_bytes_per_peer=PEER_BODY_FACTOR * config.max_body,
                        allow_sources=config.allow_sources)
        super().__init__(listen_tcp(host, port), _Handler, limits, name="github-webhooks",
                         error_body=_message_body, gate=self._gate)

    def _gate(self, head: Head) -> Refusal | None:
        answer = self.receiver.check_form(head.method, head.target, head.headers)
        if answer is None:
            return None
        return Refusal(answer.status, answer.message, (("Allow", "POST"),) if answer.status == 405 else ())


def _message_body(message: str) -> bytes:
    return json.dumps({"message": message}).encode()


class WebhookServer:
    """The endpoint on its own thread; `port` is the bound port (useful when asked for port 0)."""

    def __init__(self, receiver: WebhookReceiver, host: str = "127.0.0.1", port: int = 0) -> None:
        self.httpd = _Server(receiver, host, port)

    @property
    def port(self) -> int:
        return int(self.httpd.address[1])

    def delivery_counts(self) -> dict[tuple[str, str], int]:
        """Requests answered by the receiver, by (event, result)."""
        return self.httpd.receiver.counts()

    def start(self) -> None:
        self.httpd.start()

    def close(self) -> None:
        self.httpd.close()
