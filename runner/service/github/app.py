"""What the host reads, once, of the GitHub App settings (`github_config`, `runners.github_config`)
and of the fork guard's rules file ($MICROVM_CHECK_GUARD_RULES), for the parts it assembles: the
repositories' policy files on their default branches, the pull requests' check runs, and the guard
the runner desk runs for fleet and registered runners (runner/service/github/desk.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import ConfigError
from runner.service.config.settings import ServiceConfig
from runner.service.github.checkruns import CheckRunReporter
from runner.service.github.desk import GuardSetup

if TYPE_CHECKING:
    from runner.github.client import GitHubClient
    from runner.github.policy_source import PolicySource


def branch_files(config: ServiceConfig) -> PolicySource | None:
    """The repositories' own policy files, read as the org's GitHub App; None without App settings."""
    if config.github_config is None:
        return None
    from runner.github.config import load_settings
    from runner.github.errors import GitHubError
    from runner.github.policy_source import PolicySource

    try:
        return PolicySource(load_settings(config.github_config).app().as_installation)
    except GitHubError as exc:
        raise ConfigError(f"github_config: {exc}") from exc


def check_run_reporter(config: ServiceConfig, keyid: str) -> CheckRunReporter | None:
    """The pull requests' check runs, posted as the GitHub App; None without the App or a policy store
    (whose repository files say which repositories want them)."""
    if config.github_config is None or config.policy_dir is None:
        return None
    from policy import PolicyStore
    from runner.github.checks import CheckRuns
    from runner.github.config import load_settings

    path = config.github_config
    return CheckRunReporter(lambda: CheckRuns(load_settings(path).app().as_installation),
                            PolicyStore(config.policy_dir), config.public_url, keyid)


def guard_setup(config: ServiceConfig, environ: Mapping[str, str] = os.environ) -> GuardSetup:
    """The fork guard's rules (the file $MICROVM_CHECK_GUARD_RULES names, else none), read now; a file
    that cannot be read makes the guard refuse every job, saying why. The App client is made when a
    fork pull request needs GitHub."""
    from runner.github import guard
    from runner.github.errors import GitHubError

    path = environ.get(guard.GUARD_RULES_ENV)
    try:
        rules, problem = guard.load_rules(Path(path) if path else None), None
    except GitHubError as exc:
        rules, problem = guard.GuardRules(), str(exc)
    return GuardSetup(rules, _installation(config.runners.github_config or config.github_config), problem)


def _installation(path: Path | None) -> Callable[[], GitHubClient]:
    """The App's installation client, made only when the guard needs GitHub (a fork pull request)."""
    def client() -> GitHubClient:
        from runner.github.config import load_settings
        from runner.github.errors import GitHubError

        if path is None:
            raise GitHubError("the service has no GitHub App settings (github_config) to check fork pull requests with")
        return load_settings(path).app().as_installation
    return client
