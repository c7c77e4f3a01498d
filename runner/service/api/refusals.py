"""The job API's refusals and the one table from them to HTTP statuses.

The job API is served over HTTP/1.1 on a Unix socket (group-restricted) and, when configured, on TCP with
a token. Its parts, each in its own module:

- `listeners.py`: the Unix and TCP servers (`ApiServers`), on `runner.httpserve` (h11 parses and frames
  the HTTP/1.1; heads are read by one selector thread under overall deadlines, at most MAX_WORKERS
  requests are served at once);
- `paths.py`: the path table: each route's path, its listeners, the resource that answers it and what
  the gate checks on its head; the gate and the Handler both read it;
- `gates.py`: what is decided on a request's head, before any body is read or a worker is taken (the TCP
  token, the caller's right to send that body);
- `handler.py`: one request (its body, its answer, a refusal turned into its status here, the metrics);
  routes see it as an `exchange.Exchange`, never the Handler itself;
- the resources: `jobroutes.py` (/v1/jobs: submit, checkout, logs, artifacts, attestation, cancel; the
  terminal in `attach.py`), `sandboxroutes.py` (/v1/sandboxes), `webroutes.py` (the page and /metrics on
  TCP), `hostroutes.py` (health, the attestation key, the host's status, the runners' job hooks).

Bodies are streamed both ways: a checkout goes straight from the socket to the job's spool file, logs are
a chunked NDJSON stream copied from the job's log file, artifacts are copied from disk in chunks. See
docs/job-api.md for the routes.
"""

from __future__ import annotations

from runner import jsonbody
from runner.errors import JobError
from runner.httpserve import BadRequestBody
from runner.service.jobs.admission import InvalidJob, TooLarge
from runner.service.jobs.auth import Forbidden, Unauthorized
from runner.service.jobs.egress import EgressPolicyError, PolicySourceUnavailable
from runner.service.jobs.job import SessionGone
from runner.service.jobs.jobqueue import QueueClosed, QueueFull
from runner.service.jobs.sandboxes import (
    SandboxCallError,
    SandboxLimit,
    SandboxNotFound,
    SandboxRefused,
    SandboxStateConflict,
    SandboxUnavailable,
)
from runner.service.jobs.service import JobNotFound, JobStateConflict
from runner.service.jobs.sessions import SessionConflict
from runner.service.jobs.spec import SpecError


class BodyFramingError(JobError):
    """A request body that is not valid HTTP framing."""


class BadRequest(JobError):
    """A request this edge cannot read: a query parameter, a JSON body."""


class NoRoute(JobError):
    """No route for the path."""


class MethodNotAllowed(JobError):
    """A route that does not take this method."""


# The one place a domain error becomes an HTTP status. The service raises errors that say what went
# wrong (runner.errors.JobError and its subclasses) and knows nothing of HTTP; every JobError subclass
# has its own entry here (tests/service/api/test_api_errors.py walks the tree), looked up along the MRO.
# Anything else that reaches a route is a bug: 500, with its traceback in the service's log.
STATUS: dict[type[JobError], int] = {
    JobError: 400,
    BadRequest: 400,
    BodyFramingError: 400,
    BadRequestBody: 400,
    InvalidJob: 400,
    SpecError: 400,
    EgressPolicyError: 400,
    PolicySourceUnavailable: 503,  # GitHub is down: with Retry-After, so clients wait it out
    jsonbody.JsonBodyError: 400,
    Unauthorized: 401,
    Forbidden: 403,
    JobNotFound: 404,
    NoRoute: 404,
    MethodNotAllowed: 405,
    JobStateConflict: 409,
    SessionConflict: 409,
    SessionGone: 410,
    TooLarge: 413,
    QueueFull: 429,
    QueueClosed: 503,
    SandboxCallError: 400,
    SandboxRefused: 403,
    SandboxNotFound: 404,
    SandboxStateConflict: 409,
    SandboxLimit: 429,
    SandboxUnavailable: 503,
}


def status_of(exc: JobError) -> int:
    """The HTTP status for a refusal: its class's entry, else its nearest base's."""
    return next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)
