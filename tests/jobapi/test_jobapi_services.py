"""The `services:` of a job spec: one parser for the action's input and the service's spec, errors with where."""

from __future__ import annotations

import pytest

from runner.jobapi.contract import JobSpec, ServiceContainer, parse_services


def test_services_round_trip_the_wire_and_are_left_out_when_none() -> None:
    services = parse_services([{"name": "db", "build": "svc", "ports": ["5432", "8080:80"], "env": {"A": 1},
                                "ready": "true", "ready_timeout_seconds": 5}])
    assert services == (ServiceContainer("db", None, "svc", {"A": "1"}, ("5432", "8080:80"), "true", 5),)
    wire = JobSpec("o/r", "0" * 40, "x", services=services).to_wire()
    assert parse_services(wire["services"]) == services
    assert "services" not in JobSpec("o/r", "0" * 40, "x").to_wire()  # a service that predates it takes the spec


@pytest.mark.parametrize(("services", "message"), [
    ([{"name": "db"}], r"services\[0\]: give exactly one of image"),
    ([{"name": "db", "image": "x", "build": "y"}], r"services\[0\]: give exactly one"),
    ([{"name": "DB", "image": "x"}], r"services\[0\]\.name"),
    ([{"name": "db", "image": "x; rm -rf /"}], r"services\[0\]\.image: not a Docker image reference"),
    ([{"name": "db", "build": "../up"}], r"services\[0\]\.build"),
    ([{"name": "db", "image": "x", "ports": [70000]}], r"services\[0\]\.ports"),
    ([{"name": "db", "image": "x", "env": {"1X": "v"}}], r"services\[0\]\.env"),
    ([{"name": "db", "image": "x", "ready_timeout_seconds": 0}], r"ready_timeout_seconds"),
    ([{"name": "db", "image": "x"}, {"name": "db", "image": "y"}], "same name"),
    ([{"name": "db", "image": "x", "privileged": True}], r"unknown keys \['privileged'\]"),
    ({"name": "db"}, "expected a list"),
])
def test_bad_services_say_what_and_where(services: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_services(services)
