"""`microvm-check register | deregister | runners | redeliver | guard | runner | status`: the host's side of
the GitHub org, and its ephemeral runners (`runner.fleet`)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import textwrap
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import UserError
from runner.fleet import hook
from runner.github import guard, runners
from runner.github.app import GitHubApp
from runner.github.client import GitHubClient
from runner.github.config import DEFAULT_CONFIG_PATH, GitHubSettings, load_settings
from runner.github.deliveries import RedeliverySweep
from runner.github.errors import GitHubError
from runner.github.guard import GUARD_RULES_ENV

if TYPE_CHECKING:
    from runner.service.config.settings import ServiceConfig


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config_help = f"GitHub App settings (YAML; default {DEFAULT_CONFIG_PATH} or $MICROVM_CHECK_GITHUB_CONFIG)"

    cmd = subparsers.add_parser("register", help="register this host's runner with the org")
    _common(cmd, config_help)
    cmd.add_argument("--labels", help="comma-separated runner labels (default: the config's labels)")
    cmd.add_argument("--runner-group", help="runner group: its ID with --jit, its name for config.sh")
    cmd.add_argument("--runner-dir", type=Path, help="actions/runner directory: run config.sh/run.sh there")
    cmd.add_argument("--jit", action="store_true", help="use a just-in-time (single job) runner config")
    cmd.add_argument("--name", default=socket.gethostname(), help="runner name (default: the host name)")
    cmd.add_argument("--show-token", action="store_true", help="print the token instead of <redacted>")
    cmd.add_argument("--guard-rules", type=Path, help="guard rules file for the job-started hook")
    cmd.add_argument("--service-config", type=Path,
                     help="with --runner-dir: give the runner a credential of this service and the service's hooks "
                          "(`runner credential`), so its jobs are bound to it as a fleet runner's are")
    cmd.add_argument("--hooks-dir", type=Path, default=DEFAULT_HOOKS_DIR, help="where the root-owned hooks go")
    cmd.add_argument("--repository", metavar="OWNER/NAME", help=REPOSITORY_HELP)
    cmd.set_defaults(func=cmd_register)

    cmd = subparsers.add_parser("deregister", help="remove this host's runner from the org")
    _common(cmd, config_help)
    cmd.add_argument("--runner-dir", type=Path, help="actions/runner directory: run `config.sh remove` there")
    cmd.add_argument("--name", default=socket.gethostname(), help="runner to delete (default: the host name)")
    cmd.add_argument("--show-token", action="store_true", help="print the token instead of <redacted>")
    cmd.set_defaults(func=cmd_deregister)

    cmd = subparsers.add_parser("runners", help="list the org's runners, ours marked by label")
    _common(cmd, config_help)
    cmd.add_argument("--labels", help="comma-separated labels that mark our runners (default: the config's)")
    cmd.set_defaults(func=cmd_runners)

    cmd = subparsers.add_parser("redeliver", help="ask GitHub to redeliver failed webhook deliveries")
    cmd.add_argument("--config", type=Path, help=config_help)
    cmd.add_argument("--window", type=float, default=3 * 3600, help="how far back to look, in seconds (3 h)")
    cmd.add_argument("--every", type=float, help="keep sweeping every this many seconds (default: once)")
    cmd.set_defaults(func=cmd_redeliver)

    cmd = subparsers.add_parser("runner", help="the ephemeral runners the service keeps (runners: section)")
    actions = cmd.add_subparsers(dest="runner_command", required=True)
    install = actions.add_parser("install", help="install the actions/runner release runners are copied from")
    install.add_argument("--version", required=True, help="runner release, e.g. 2.336.0")
    install.add_argument("--from", dest="tarball", type=Path,
                         help="a local actions-runner-linux-x64-V.tar.gz (default: download it from GitHub)")
    install.add_argument("--sha256", required=True,
                         help="the tarball's SHA-256, from the release page (required: no digests are shipped)")
    install.add_argument("--service-config", type=Path, default=Path("/etc/microvm-check/service.yml"),
                         help="the service config whose runners.install_dir to use")
    install.set_defaults(func=cmd_runner_install)
    credential = actions.add_parser("credential", help="give a registered runner a credential of the service and "
                                                       "its job hooks (runner/fleet/registered.py)")
    credential.add_argument("--runner-dir", type=Path, required=True, help="the runner's directory (its .env)")
    credential.add_argument("--name", default=socket.gethostname(), help="the runner's name (default: the host name)")
    credential.add_argument("--hooks-dir", type=Path, default=DEFAULT_HOOKS_DIR, help="where the root-owned hooks go")
    credential.add_argument("--service-config", type=Path, default=Path("/etc/microvm-check/service.yml"),
                            help="the service whose credential it gets (its state_dir and socket)")
    credential.add_argument("--repository", metavar="OWNER/NAME", help=REPOSITORY_HELP)
    credential.set_defaults(func=cmd_runner_credential)
    for name, func in (("job-started", cmd_runner_job_started), ("job-completed", cmd_runner_job_completed)):
        hook_cmd = actions.add_parser(name, help=f"{name} hook of the fleet's runners (not for people)")
        hook_cmd.add_argument("--socket", required=True, help="the job API's Unix socket")
        hook_cmd.set_defaults(func=func)

    cmd = subparsers.add_parser("status", help="the running service's VMs, spare pools, queue, jobs, runners",
                                description="What the running service holds now, asked on its socket (GET "
                                            "/v1/status): for the operator (root or the config's admin_group).")
    cmd.add_argument("--config", "--service-config", dest="service_config", type=Path,
                     default=Path("/etc/microvm-check/service.yml"), help="the running service's config (its socket)")
    cmd.add_argument("--socket", help="the service's socket (default: the config's)")
    cmd.add_argument("--json", action="store_true", help="the raw status as JSON")
    cmd.set_defaults(func=cmd_status)

    cmd = subparsers.add_parser("guard", help="job-started hook: refuse untrusted fork workflows")
    cmd.add_argument("--config", type=Path, help=config_help)
    cmd.add_argument("--rules", type=Path, help=f"per-repository guard rules (YAML; default ${GUARD_RULES_ENV})")
    cmd.set_defaults(func=cmd_guard)


def _common(cmd: argparse.ArgumentParser, config_help: str) -> None:
    cmd.add_argument("--config", type=Path, help=config_help)
    cmd.add_argument("--org", help="organisation login (default: the config's org)")


def _setup(args: argparse.Namespace) -> tuple[GitHubSettings, GitHubApp, str]:
    settings = load_settings(args.config)
    org = args.org or settings.org
    if not org:
        raise GitHubError("no organisation: pass --org or set org in the GitHub config")
    app = settings.app()
    return settings, app, org


def _labels(args: argparse.Namespace, settings: GitHubSettings) -> list[str]:
    if not getattr(args, "labels", None):
        return list(settings.labels)
    labels = [label.strip() for label in args.labels.split(",") if label.strip()]
    if not labels:
        raise GitHubError("--labels must name at least one label")
    return labels


def web_url(api_url: str) -> str:
    """github.com for the public API, the server itself for GitHub Enterprise Server (`/api/v3`)."""
    api_url = api_url.rstrip("/")
    if api_url == "https://api.github.com":
        return "https://github.com"
    return api_url.removesuffix("/api/v3")


DEFAULT_HOOKS_DIR = Path("/opt/microvm-check/runner-hooks")
REPOSITORY_HELP = ("with a credential: the one repository whose jobs the runner takes (required on a service without "
                   "a webhook, where nothing else says which job GitHub gave the runner)")
SINGLE_RUNNER = (
    "note: this is ONE runner: it takes one job at a time, and keeps its workspace between jobs; jobs it submits "
    "are bound to the job its hook reports when it has a credential of the service (--service-config), else they "
    "run as the service's local_jobs.repository (docs/job-api.md). For several jobs at once, each on a fresh "
    "runner bound to its job, give the service a runners: section instead (docs/fleet.md)")


def cmd_register(args: argparse.Namespace) -> int:
    settings, app, org = _setup(args)
    admin = runners.RunnerAdmin(app.as_installation, org)
    labels = _labels(args, settings)
    if args.jit:
        group = _group_id(args.runner_group)
        jit = admin.jit_config(args.name, labels, group)
        print(f"runner {jit.runner.name} (id {jit.runner.id}) registered just in time with labels {', '.join(labels)}")
        command = runners.jit_run_command(jit)
    else:
        token = admin.registration_token()
        org_url = f"{web_url(settings.api_url)}/{org}"
        command = runners.config_command(org_url, token, args.name, labels, args.runner_group)
        print(f"registration token for org {org} expires at {token.expires_at}")
    if args.service_config is not None and args.runner_dir is not None:
        _issue_credential(args.service_config, args.name, args.runner_dir, args.hooks_dir, args.repository)
    else:
        _install_guard(args)
    print(SINGLE_RUNNER)
    return _run_or_print(command, args.runner_dir, args.show_token)


def _install_guard(args: argparse.Namespace) -> None:
    argv = hook.guard_argv(args.config, args.guard_rules)
    if args.runner_dir is None:
        print(f"then refuse untrusted fork workflows: save this as a script and set {hook.HOOK_VARIABLE}=<its path>")
        print("in the runner's .env (or pass --runner-dir to have it done):")
        print(textwrap.indent(hook.hook_script(argv), "  "), end="")
        return
    if not args.runner_dir.is_dir():
        raise GitHubError(f"--runner-dir {args.runner_dir} is not a directory: unpack the actions/runner release there")
    script = hook.install_guard_hook(args.runner_dir, argv)
    print(f"installed the fork guard as the runner's job-started hook: {script}")


def cmd_deregister(args: argparse.Namespace) -> int:
    _, app, org = _setup(args)
    admin = runners.RunnerAdmin(app.as_installation, org)
    if args.runner_dir:
        return _run_or_print(runners.remove_command(admin.remove_token()), args.runner_dir, args.show_token)
    runner = admin.find(args.name)
    if runner is None:
        raise GitHubError(f"org {org} has no runner named {args.name!r}: see `microvm-check runners`")
    admin.delete(runner.id)
    print(f"deleted runner {runner.name} (id {runner.id}) from org {org}")
    return 0


def cmd_runners(args: argparse.Namespace) -> int:
    settings, app, org = _setup(args)
    labels = _labels(args, settings)
    found = runners.RunnerAdmin(app.as_installation, org).list()
    for runner in found:
        mark = "*" if runner.is_ours(labels) else " "
        state = f"{runner.status}{', busy' if runner.busy else ''}"
        print(f"{mark} {runner.id:>8}  {runner.name:<30} {state:<14} {', '.join(runner.labels)}")
    print(f"{len(found)} runner(s) in org {org}; * = ours (labels {', '.join(labels)})")
    return 0


def cmd_redeliver(args: argparse.Namespace) -> int:
    """One sweep (for a timer), or a loop with --every (for a service) until interrupted."""
    settings = load_settings(args.config)
    sweep = RedeliverySweep(settings.app().as_app, window=args.window)
    if args.every:
        sweep.run(threading.Event(), interval=args.every)
        return 0
    ids = sweep.sweep()
    print(f"asked GitHub to redeliver {len(ids)} failed deliveries" + (f": {', '.join(map(str, ids))}" if ids else ""))
    return 0


def cmd_guard(args: argparse.Namespace) -> int:
    """Exit 0 to let the job run; 1 with `::error::` lines (shown in the job log) to refuse it."""
    rules_path = args.rules or (Path(os.environ[GUARD_RULES_ENV]) if os.environ.get(GUARD_RULES_ENV) else None)
    try:
        job = guard.job_context(os.environ)
        rules = guard.load_rules(rules_path).for_repository(job.repository)
        verdict = guard.evaluate(job, rules, lambda: _installation_client(args.config))
    except GitHubError as exc:
        verdict = guard.Verdict(False, (f"the guard could not check this job ({exc}), so it refuses it.",))
    for line in guard.error_lines(verdict):
        print(line, flush=True)
    if verdict.allowed:
        print("microvm-check guard: job allowed", file=sys.stderr)
    return 0 if verdict.allowed else 1


def _service_config(path: Path) -> ServiceConfig:
    from runner.service.config.reading import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        raise UserError(str(exc)) from exc


def cmd_runner_install(args: argparse.Namespace) -> int:
    """Verify and unpack the release once; the fleet copies it for every runner."""
    import tempfile

    from runner.fleet import install

    install_dir = _service_config(args.service_config).runners.install_dir
    try:
        version = install.check_version(args.version)
        with tempfile.TemporaryDirectory(prefix="mvc-runner-") as scratch:
            tarball = args.tarball or install.download(version, Path(scratch))
            release = install.install(tarball, version, args.sha256, install_dir)
    except install.InstallError as exc:
        raise UserError(str(exc)) from exc
    print(f"installed actions/runner {release.version} in {release.path} (read-only); new runners start from it")
    return 0


def cmd_runner_credential(args: argparse.Namespace) -> int:
    _issue_credential(args.service_config, args.name, args.runner_dir, args.hooks_dir, args.repository)
    return 0


def _issue_credential(service_config: Path, name: str, runner_dir: Path, hooks_dir: Path,
                      repository: str | None) -> None:
    from runner.fleet import registered

    config = _service_config(service_config)
    env_file = registered.issue(config.state_dir, name, runner_dir, hooks_dir, config.socket, repository)
    print(f"runner {name} has a credential of the service in {env_file} (0600) and reports its jobs with the hooks "
          f"in {hooks_dir}; restart the service to let it in")
    if repository is None and config.webhook.listen is None:
        print(f"warning: runner {name} takes no job: this service has no webhook to say which job GitHub gives it, "
              "so its credential must name the repository it serves (--repository OWNER/NAME)")


def cmd_runner_job_started(args: argparse.Namespace) -> int:
    """Report this runner's job to the service, whose fork guard allows (0) or refuses (1) it."""
    return hook.job_started(args.socket, os.environ, sys.stdout)


def cmd_runner_job_completed(args: argparse.Namespace) -> int:
    """Tell the service this runner's job ended: what it still runs is cancelled, its VMs destroyed."""
    return hook.job_completed(args.socket, os.environ, sys.stdout)


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from runner.commands.status import render
    from runner.jobapi.client import JobAPIError, JobClient

    where = args.socket or _service_config(args.service_config).socket
    try:
        with JobClient(socket=where) as client:
            data = client.status()
    except JobAPIError as exc:
        hint = " (status is for the operator: root or the config's admin_group)" if exc.status == 403 else \
            " (is `microvm-check serve` running with this config?)"
        raise UserError(f"{exc}{hint}") from exc
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


def _installation_client(config: Path | None) -> GitHubClient:
    return load_settings(config).app().as_installation


def _group_id(value: str | None) -> int:
    if value is None:
        return runners.DEFAULT_RUNNER_GROUP_ID
    if not value.isdigit():
        raise GitHubError(f"--runner-group must be the group's numeric ID with --jit, not {value!r}")
    return int(value)


def _run_or_print(command: runners.RunnerCommand, runner_dir: Path | None, show_token: bool) -> int:
    if runner_dir is None:
        print("run this in the actions/runner directory:")
        print(f"  {command.display(show_token)}")
        return 0
    return command.run(runner_dir)
