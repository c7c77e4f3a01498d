"""Who may do what on this host, from its config: the `Access` the service applies (`access_for`), and
what binds a runner's submits to a job said in words for `config check` and `doctor` (`runner_binding`),
both from the one rule `placed_by_webhook`."""

from __future__ import annotations

from runner.fleet import registered
from runner.fleet.registered import Credential
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.auth import Access


def access_for(config: ServiceConfig, registered: dict[str, Credential] | None = None) -> Access:
    """Who may do what on this service (runner/service/jobs/auth.py); `registered`: the runner credentials
    `microvm-check register --service-config` left in the state directory (the host reads them)."""
    return Access(config.admin_group, fleet=config.runners.org is not None,
                  local_repository=config.local_jobs.repository, registered=registered,
                  binding_seconds=config.runners.job_timeout_seconds + config.runners.deadline_grace_seconds,
                  placed_by_webhook=placed_by_webhook(config))


def placed_by_webhook(config: ServiceConfig) -> bool:
    """Whether GitHub's `in_progress` deliveries say which job a registered runner runs: the one authority
    on it a job cannot speak for (without it, the operator holds each runner to one repository)."""
    return config.webhook.listen is not None


def runner_binding(config: ServiceConfig) -> list[str]:
    """Which job a runner's submits are bound to on this host, and what that allows: for `config check`
    and `doctor`, from the same settings `access_for` reads."""
    lines = []
    if config.runners.org is not None:
        lines.append("fleet runners: each is bound to the one job its hook reports before any step, and its "
                     "token ends with that job")
    if placed_by_webhook(config):
        lines.append("registered runners (`runner credential`): webhook mode: bound only to the run GitHub's signed "
                     "workflow_job in_progress delivery puts on the runner (its name on GitHub = its credential's "
                     "name; webhook.labels must cover its jobs), and to its credential's repository when one is "
                     "named; a job's own report or job-completed call cannot rebind it")
    else:
        lines.append("registered runners (`runner credential`): repository mode (no webhook): each is held to the "
                     "repository its credential names (`runner credential --repository OWNER/NAME`); one whose "
                     "credential names none takes no job")
    lines.extend(_registered_runners(config))
    local = config.local_jobs.repository
    members = ("health only (a fleet host)" if config.runners.org is not None else
               f"local jobs, run as {local} under its policy" if local is not None else
               "may not submit (local_jobs.repository is unset)")
    lines.append(f"socket members without a credential: {members}")
    return [f"runner binding: {line}" for line in lines]


def _registered_runners(config: ServiceConfig) -> list[str]:
    """What each registered runner's credential in the state directory lets it take, in this mode."""
    try:
        credentials = registered.load(config.state_dir)
    except OSError as exc:
        return [f"registered runners' credentials in {config.state_dir}: not readable here ({exc.strerror}); "
                "run as root to list them"]
    webhook = placed_by_webhook(config)
    lines = []
    for name, credential in sorted(credentials.items()):
        if credential.repository is not None:
            takes = f"jobs of {credential.repository} only" + (", as GitHub places them" if webhook else "")
        else:
            takes = "the jobs GitHub places on it" if webhook else "no job (its credential names no repository)"
        lines.append(f"registered runner {name}: takes {takes}")
    return lines
