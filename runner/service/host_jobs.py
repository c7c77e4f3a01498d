"""The host's job side, built for ServiceHost (runner/service/host.py): the job service with what the
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
from runner.service.attestation import JobAttestor
from runner.service.binding import access_for
from runner.service.config import ServiceConfig
from runner.service.egress import EgressPolicies
from runner.service.github_app import branch_files, check_run_reporter
from runner.service.jobparts import job_parts
from runner.service.retention import Retention
from runner.service.service import JobService

if TYPE_CHECKING:
    from runner.service.workers import JobVMs


def start_service(config: ServiceConfig, vms_for: Callable[[EgressPolicies], JobVMs], policies: EgressPolicies | None,
                  stack: ExitStack, origin: str | None) -> JobService:
    """The job service, started: it fails the jobs a dead predecessor left active and sweeps their
    directories now. `vms_for` makes the VMs its jobs run in, with the warm bases on its policies'
    GitHub source (runner/service/host_github.py `job_vms`)."""
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
