"""The job API's path table: each route's path, the listeners it is on, the resource that answers it and
what is checked on its head. The gate (gates.py, before a body is read or a worker taken) and the Handler
(which route answers) both read it, so a path is declared once and both decide on the same entry.

Where a resource's own calls are a contract of their own, the table holds the resource's subtree and the
resource tells its calls apart: the sandboxes' (microvm_check.contract.Route, sandboxroutes.route) and the
page's (page.py's). docs/job-api.md and docs/sdk.md describe the routes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from microvm_check.contract import SANDBOXES
from runner.service.api import hostroutes, jobroutes, page, sandboxroutes, webroutes
from runner.service.api.exchange import Exchange

UNIX, TCP = "unix", "tcp"  # the listeners (exchange.Listener.kind)
BOTH = frozenset({UNIX, TCP})
GET, GET_POST = frozenset({"GET"}), frozenset({"GET", "POST"})

Answer = Callable[[Exchange, Mapping[str, str]], None]  # a resource's answer, given its pattern's groups


class Check(Enum):
    """What the gate checks on a POST or PUT head (a body is never read for a caller refused after it)."""

    NOTHING = "nothing"  # the route checks, after the head
    RUNNER = "runner"  # a runner's token: the fleet's hooks
    SUBMIT = "submit"  # whether this caller may submit at all (Access.admit_submit decides the rest, on the spec)
    JOB = "job"  # the job's own token or the operator: a checkout, a cancel
    SANDBOX = "sandbox"  # create: the operator or sandboxes.group; a sandbox's call: its token (sandboxroutes.vet)


@dataclass(frozen=True)
class Route:
    """One entry of the table. `pattern` matches the whole path; its named groups go to `answer`. A path
    asked with a method not in `methods` is on no route (404), as a path that matches nothing."""

    pattern: re.Pattern[str]
    answer: Answer
    methods: frozenset[str] | None = None  # None: every method, the resource refuses what it does not take (405)
    listeners: frozenset[str] = BOTH
    check: Check = Check.NOTHING
    urgent: bool = False  # takes the reserved workers and goes first: a job must always be reported
    page_token: bool = False  # the page's cookie or ?token= stands for the TCP bearer token (gates.py)


@dataclass(frozen=True)
class Found:
    """The route a path is on, and its pattern's groups ("" for an optional group the path left out)."""

    route: Route
    params: Mapping[str, str]


# The job id may hold no whitespace (so "/v1/jobs/<id>\n" is no route), and `rest` is one of the job's calls
# or nothing.
JOB_PATH = re.compile(r"/v1/jobs/(?P<id>[^/\s]+)(?P<rest>/checkout|/logs|/artifacts|/attestation|/cancel|/terminal)?")

# First match wins; each pattern must match the whole path.
TABLE: tuple[Route, ...] = (
    Route(re.compile(r"(?P<path>/metrics)"), webroutes.answer, listeners=frozenset({TCP})),
    Route(re.compile("(?P<path>" + re.escape(page.PREFIX) + "(?:/.*)?)"), webroutes.answer, listeners=frozenset({TCP}),
          page_token=True),
    Route(re.compile(r"/v1/health"), hostroutes.health, GET),
    Route(re.compile(r"/v1/attestation-key"), hostroutes.attestation_key, GET),
    Route(re.compile("(?P<path>" + re.escape(SANDBOXES) + "(?:/.*)?)"), sandboxroutes.answer, check=Check.SANDBOX),
    Route(re.compile(r"/v1/jobs"), jobroutes.collection, GET_POST, check=Check.SUBMIT),
    Route(re.compile(r"/v1/status"), hostroutes.status, GET),
    Route(re.compile(r"/v1/runner/job-(?P<hook>started|completed)"), hostroutes.runner_hook, check=Check.RUNNER,
          urgent=True),
    Route(JOB_PATH, jobroutes.job, check=Check.JOB),
)


def find(method: str, path: str, listener: str) -> Found | None:
    """The route a request for `path` is on, asked with `method` on `listener`, or None."""
    for route in TABLE:
        match = route.pattern.fullmatch(path)
        if match is not None and listener in route.listeners and (route.methods is None or method in route.methods):
            return Found(route, {name: value or "" for name, value in match.groupdict().items()})
    return None


def job_route(path: str) -> tuple[str, str] | None:
    """(job id, its call such as "/logs" or "") for a path under /v1/jobs/<id>, else None: the job route's
    pattern as a caller outside the table reads it."""
    match = JOB_PATH.fullmatch(path)
    return (match.group("id"), match.group("rest") or "") if match else None
