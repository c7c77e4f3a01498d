"""The job API's routes about the service itself rather than one job or sandbox: its health and the
attestation key (public), the host's status (the operator's), and the runners' job hooks (answered by the
runner desk; urgent, runner/service/api/paths.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from runner.jobapi.contract import Health, JobStarted, WireError
from runner.service.api.refusals import BadRequest, MethodNotAllowed
from runner.service.jobs.auth import Forbidden, Unauthorized

if TYPE_CHECKING:
    from runner.service.api.exchange import Exchange

T = TypeVar("T")


def health(ex: Exchange, params: Mapping[str, str]) -> None:
    ex.send_json(200, _health(ex).to_wire())


def _health(ex: Exchange) -> Health:
    """The counts are the whole host's activity, every repository's: the operator's to see, not a
    socket member's or a runner's (they get whether the service is up, and its accelerator)."""
    health = ex.service.health()
    try:
        operator = ex.caller().operator
    except Unauthorized:
        operator = False
    return health if operator else health.without_counts()


def attestation_key(ex: Exchange, params: Mapping[str, str]) -> None:
    """Public: what verifiers check the jobs' signed records with."""
    ex.respond(200, ex.service.attestation_key().encode(), {"Content-Type": "application/x-pem-file"})


def status(ex: Exchange, params: Mapping[str, str]) -> None:
    ex.service.access.require_operator(ex.caller(), "the host's status")
    ex.send_json(200, ex.listener.host_status())


def runner_hook(ex: Exchange, params: Mapping[str, str]) -> None:
    """A fleet runner's job-started or job-completed hook, for the runner desk."""
    if ex.method != "POST":
        raise MethodNotAllowed(f"{ex.method} is not allowed on {ex.path}")
    runner, desk = ex.service.access.require_runner(ex.caller()), ex.listener.desk
    if desk is None:  # a server built without the host's runner desk (tests of the API alone)
        raise Forbidden("this server takes no runner reports")
    if params["hook"] == "started":
        started = _wire(JobStarted.from_wire, ex.json_body())
        return ex.send_json(200, desk.runner_job_started(runner, started).to_wire())
    ex.send_json(200, {"cancelled": desk.runner_job_completed(runner)})


def _wire(parse: Callable[[object], T], data: object) -> T:
    """A request body in one of the contract's shapes (`parse` is its `from_wire`), or a 400 naming the field."""
    try:
        return parse(data)
    except WireError as exc:
        shape = parse.__qualname__.partition(".")[0]  # "JobStarted.from_wire" -> "JobStarted"
        raise BadRequest(f"the body is not a {shape}: {exc}") from exc
