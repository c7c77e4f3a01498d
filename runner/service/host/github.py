"""The host's GitHub side, built for ServiceHost (runner/service/host/assembly.py): the runner desk (registry,
bindings and the fork guard, with the guard's rules read once and the App client), the reactions to
GitHub's webhooks, the webhook listener that delivers them (to the fleet as well, when there is one), and
the VMs jobs run in, with the repositories' warm bases built from their default branches.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from runner.service.config.settings import ServiceConfig
from runner.service.github.app import guard_setup
from runner.service.github.desk import RunnerDesk
from runner.service.github.reactions import GitHubReactions
from runner.service.github.webhook import JobHookListeners, Webhook, start_webhook
from runner.service.jobs.workers import JobVMs

if TYPE_CHECKING:
    from runner.fleet.fleet import RunnerFleet
    from runner.sandbox.port import SandboxFactory, SandboxProvider
    from runner.service.jobs.bases import RepositoryBases
    from runner.service.jobs.egress import EgressPolicies
    from runner.service.jobs.service import JobService


def runner_desk(config: ServiceConfig, service: JobService) -> tuple[RunnerDesk, GitHubReactions]:
    """The runners' desk and what GitHub's job events do to the service and to it."""
    desk = RunnerDesk(service, guard_setup(config))
    return desk, GitHubReactions(service, desk)


def webhook(config: ServiceConfig, reactions: GitHubReactions, fleet: RunnerFleet | None, stack: ExitStack,
            origin: str | None) -> Webhook | None:
    """The webhook listener (when `webhook.listen` is set), with its redelivery sweep; the fleet hears
    the deliveries too."""
    hooks = reactions if fleet is None else JobHookListeners((reactions, fleet))
    where = f"{origin}: webhook" if origin else "webhook"
    listener = start_webhook(config.webhook, hooks, where)
    if listener is not None:
        stack.callback(listener.close)
    return listener


def job_vms(config: ServiceConfig, create: SandboxFactory, provider: SandboxProvider | None,
            policies: EgressPolicies, stack: ExitStack) -> JobVMs:
    """The VMs jobs run in: the host's sandbox factory, with the repositories' warm bases on its engine."""
    return JobVMs(create, _warm_bases(config, provider, policies, stack))


def _warm_bases(config: ServiceConfig, provider: SandboxProvider | None, policies: EgressPolicies,
                stack: ExitStack) -> RepositoryBases | None:
    """The repositories' warm bases on the engine; None without real VMs or without the App, which
    reads the default branches the bases are built from. Bases snapshot their VMs and keep the spare
    VMs in step with them, so they get the engine as a whole `SandboxProvider`."""
    if provider is None or policies.branch_files is None:
        return None
    from policy import PolicyStore
    from runner.service.jobs.bases import BaseSettings, RepositoryBases, branch_warm

    source = policies.branch_files
    bases = RepositoryBases(provider, branch_warm(PolicyStore(config.policy_dir), source), source,
                            BaseSettings.from_config(config))
    bases.evict()
    stack.callback(bases.close)  # after the service closes, before the engine: no build outlives the host
    return bases
