"""The VM port's request (runner/sandbox/port.py): what a job's VM is asked for, built in one place.

No VMs: these pin the rules the service's stand-in engine sees in every other test, where they are
easy to miss: a card only for a policy that lets something through, the size a class names."""

from __future__ import annotations

import dataclasses

import pytest

from policy import load_policy
from policy.model import DENY_ALL
from runner.sandbox.port import Resources, VMRequest, needs_network
from runner.service.config.reading import config_from_mapping
from runner.service.jobs.job import vm_request
from runner.service.jobs.templatechoice import choose_template

ALLOWS = load_policy("version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n", "test policy")
AUDITS = load_policy("version: 1\nmode: audit\n", "test policy")


def test_the_network_card_follows_from_the_policy_unless_a_variant_asks() -> None:
    assert [needs_network(p) for p in (None, DENY_ALL, ALLOWS, AUDITS)] == [False, False, True, True]
    assert VMRequest(policy=ALLOWS).network is True
    assert VMRequest(policy=DENY_ALL).network is False  # nothing to filter, nothing to get wrong
    assert VMRequest(policy=DENY_ALL, network_card=True).network is True  # a `net` warm base's setup
    assert VMRequest(policy=ALLOWS, network_card=False).network is False


def test_a_request_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        VMRequest().template = "other"  # type: ignore[misc]


def test_a_jobs_request_has_the_services_size_or_its_size_class(tmp_path) -> None:
    config = config_from_mapping({"state_dir": str(tmp_path), "resources": {"vcpus": 1, "memory_mib": 512},
                                  "sizes": {"large": {"vcpus": 2, "memory_mib": 1024, "disk_mib": 3072}}})
    plain = vm_request(config, choose_template("base"), ttl_seconds=60, policy=ALLOWS, job_id="j1")
    assert plain == VMRequest("base", 60, Resources(1, 512), ALLOWS, "j1")
    large = vm_request(config, choose_template("base", size="large"), ttl_seconds=60, policy=None, job_id="j2")
    assert large.resources == Resources(2, 1024) and large.network is False
