"""The host's runner fleet, built for ServiceHost (runner/service/host/assembly.py) when `runners:` is set, and
the sweep of the runners a dead predecessor left, which runs whether or not this config has a fleet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING

from runner.errors import ConfigError
from runner.service.api.metrics import CountedRunners, JobMetrics
from runner.service.config.settings import ServiceConfig

if TYPE_CHECKING:
    from runner.fleet.fleet import RunnerFleet
    from runner.service.github.desk import RunnerDesk

log = logging.getLogger(__name__)


def sweep_runner_scope(config: ServiceConfig) -> None:
    """Kill and remove the runners a dead predecessor of this service left in its cgroup scope, whether or
    not this config starts a fleet (runner/fleet/scope.py). After the engine: its lock makes the state
    directory this service's alone."""
    from runner.fleet.scope import sweep_stale

    swept = sweep_stale(config.state_dir)
    if swept:
        log.warning("swept runners a previous service left: %s", ", ".join(swept))


def start_fleet(config: ServiceConfig, desk: RunnerDesk, metrics: JobMetrics | None,
                extra_status: Callable[[], dict[str, object]], stack: ExitStack, origin: str | None) -> RunnerFleet:
    """The host's ephemeral runners (`runners:`), closed before the service drains: at shutdown busy
    runners finish their jobs while the service still runs them. They hear the webhook too."""
    from runner.fleet.fleet import RunnerFleet
    from runner.fleet.model import FleetSettings
    from runner.github.config import load_settings
    from runner.github.errors import GitHubError
    from runner.github.runners import RunnerAdmin

    settings = FleetSettings.from_config(config)
    where = f"{origin}: runners" if origin else "runners"
    try:
        github = load_settings(config.runners.github_config or config.github_config)
        admin = RunnerAdmin(github.app().as_installation, settings.org)
    except GitHubError as exc:
        raise ConfigError(f"{where}: the GitHub App settings: {exc}") from exc
    counted = CountedRunners(desk, metrics) if metrics is not None else desk
    fleet = RunnerFleet(settings, admin, counted, extra_status=extra_status)
    desk.on_bound(fleet.runner_bound)  # the fleet marks the runner busy as its hook reports the job
    stack.callback(fleet.close)
    try:
        fleet.start()
    except ConfigError as exc:  # no runner user, no installed release
        raise ConfigError(f"{where}: {exc}") from exc
    return fleet
