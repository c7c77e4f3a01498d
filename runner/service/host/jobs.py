"""The host's job side, built for ServiceHost (runner/service/host/assembly.py): the job service with what the
host reads from disk and the environment (the registered runners' credentials, the signing key, the
App's check runs and branch policy files), and retention.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

from runner.attest.keys import SigningKey
from runner.errors import ConfigError
from runner.fleet import registered
from runner.service.config.settings import ServiceConfig
from runner.service.github.app import branch_files, check_run_reporter
from runner.service.host.binding import access_for
from runner.service.host.retention import Retention
from runner.service.jobs.attestation import JobAttestor
from runner.service.jobs.egress import EgressPolicies
from runner.service.jobs.parts import job_parts
from runner.service.jobs.service import JobService

if TYPE_CHECKING:
    from runner.service.jobs.workers import JobVMs


def start_service(config: ServiceConfig, vms_for: Callable[[EgressPolicies], JobVMs], policies: EgressPolicies | None,
                  stack: ExitStack, origin: str | None) -> JobService:
    """The job service, started: it fails the jobs a dead predecessor left active and sweeps their
    directories now. `vms_for` makes the VMs its jobs run in, with the warm bases on its policies'
    GitHub source (runner/service/host/github.py `job_vms`)."""
    try:
        policies = policies or EgressPolicies(config.policy_dir, branch_files=branch_files(config))
        access = access_for(config, registered.load(config.state_dir))
        attestor = JobAttestor(SigningKey.load_or_create(config.attestation_key_path))
        vms = vms_for(policies)
        service = JobService(config, job_parts(config, vms, policies=policies, access=access, attestor=attestor,
                                               check_runs=check_run_reporter(config, attestor.key.keyid)))
    except ConfigError as exc:  # e.g. unreadable GitHub App settings
        raise ConfigError(f"{origin}: {exc}" if origin else str(exc)) from exc
    stack.callback(service.close)
    service.start()
    return service


def start_retention(service: JobService, stack: ExitStack) -> Retention:
    """Sweeps the job directories, prunes, and starts the reaper (after the service has started)."""
    retention = Retention(service)
    stack.callback(retention.close)
    retention.start()
    return retention
