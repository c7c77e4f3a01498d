"""The host's GitHub side, built for ServiceHost (runner/service/host.py): the runner desk (registry,
bindings and the fork guard, with the guard's rules read once and the App client), the reactions to
GitHub's webhooks, and the webhook listener that delivers them (to the fleet as well, when there is one).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING

from runner.service.config import ServiceConfig
from runner.service.desk import RunnerDesk
from runner.service.github_app import guard_setup
from runner.service.reactions import GitHubReactions
from runner.service.webhook import JobHookListeners, Webhook, start_webhook

if TYPE_CHECKING:
    from runner.fleet.fleet import RunnerFleet
    from runner.service.service import JobService


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
