"""`microvm-check policy check|render|suggest`: lint policy files, show the rules a VM would get, and
suggest one policy from what the audited jobs of a repository tried."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from policy.load import PolicyError, load_policy, raw_warnings
from policy.store import ORG_FILE
from policy.warm import WarmSpec, load_repository_file
from runner.errors import UserError

if TYPE_CHECKING:
    from runner.jobapi.contract import JobRecord

# The renderer (jinja2) and the suggester are imported by the commands that use them, not at start-up:
# `policy check` needs neither (runner/cli.py).


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("policy", help="check, render and suggest egress policies")
    commands = parser.add_subparsers(dest="policy_command", metavar="COMMAND", required=True)

    check = commands.add_parser(
        "check", help="validate policy files; print every problem like a linter",
        description="A repository's trusted file (the store's OWNER/REPO.yml or a default branch's "
                    ".github/microvm-check.yml) may have a warm: section; the org default (_org.yml) and a job's "
                    "policy (the action's policy input) may not.")
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")
    check.add_argument("--as", dest="kind", choices=CHECK_KINDS, default="auto",
                       help="what the files are (default auto: a file named _org.yml is the org default, any "
                            "other a repository's file)")
    check.set_defaults(func=check_command)

    show = commands.add_parser("render", help="print the iptables-restore rules a VM would get")
    show.add_argument("file", type=Path, metavar="FILE")
    show.add_argument("--ipv6", action="store_true", help="print the ip6tables-restore document instead")
    show.set_defaults(func=render_command)

    suggest = commands.add_parser(
        "suggest", help="one block-mode policy from what a repository's audited jobs tried",
        description="Merge the blocked (in audit mode: would-be-blocked) egress of every job of REPOSITORY in "
                    "the service's job records into one block-mode policy, with how often and when each rule "
                    "was needed as comments. Always-denied and internal destinations are never allowed.")
    suggest.add_argument("--repository", required=True, metavar="OWNER/NAME", help="the repository whose jobs to read")
    suggest.add_argument("--since", type=duration, default=duration(DEFAULT_SINCE), metavar="AGE",
                         help=f"only jobs submitted within AGE, like 14d, 12h, 30m or 2w (default {DEFAULT_SINCE})")
    source = suggest.add_mutually_exclusive_group()
    source.add_argument("--state-dir", type=Path, help="the service's state_dir (default /var/lib/microvm-check)")
    source.add_argument("--config", type=Path, help="the service's config: read its state_dir's records")
    suggest.set_defaults(func=suggest_command)


CHECK_KINDS = ("auto", "repository", "org", "job")


def check_command(args: argparse.Namespace) -> int:
    """Exit 0 when every file is valid, 1 otherwise, after printing all problems of all files; a valid
    file is named with `ok` (and its warm: section, if any), so silence never has to mean success."""
    failed = False
    for path in args.files:
        try:
            warm = _check_one(path, args.kind)
        except PolicyError as exc:
            failed = True
            print(exc)
        else:
            print(f"ok {path}" if warm is None else
                  f"ok {path} (warm: setup, {len(warm.inputs)} input pattern(s), setup egress: "
                  f"{'warm.policy within the org default' if warm.policy.rules or warm.policy.mode == 'audit' else 'none'})")
    return 1 if failed else 0


def _check_one(path: Path, kind: str) -> WarmSpec | None:
    """Load `path` as the kind of file it is; the repository's warm: section, if it has one.
    Rules enforced by address rather than by name (`raw: true`) are warned about, not refused."""
    if kind == "auto":
        kind = "org" if path.name == ORG_FILE else "repository"
    if kind == "repository":
        loaded = load_repository_file(path)
        policy, warm = loaded.policy, loaded.warm
    else:
        policy, warm = load_policy(path), None  # the org default and a job's policy: the loader refuses a warm: key
    for warning in raw_warnings(policy):
        print(f"{path}: {warning}")
    return warm


def render_command(args: argparse.Namespace) -> int:
    from policy.render import RenderContext, render

    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        raise UserError(f"{args.file} is not a valid policy:\n{exc}") from None
    # a typical VM namespace, so that the output reads like the real thing
    example = RenderContext(guest_ip="172.16.0.2", guest_mac="52:54:00:12:34:56", gateway_ip="172.16.0.1",
                            dns_ip="172.16.0.1", guest_ip6="fd00:16::2", log_prefix="mvc:example")
    rules = render(policy, example)
    print(rules.ipv6 if args.ipv6 else rules.ipv4, end="")
    return 0


DEFAULT_SINCE = "14d"
MAX_RECORDS_PER_JOB = 4096  # a job's blocked_egress derives from guest traffic; the service bounds it too
_DURATION = re.compile(r"([0-9]{1,6})([mhdw])")
_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def duration(text: str) -> float:
    """`14d`, `12h`, `30m`, `2w` as seconds (argparse type)."""
    match = _DURATION.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected an age like 14d, 12h, 30m or 2w, not {text!r}")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def suggest_command(args: argparse.Namespace) -> int:
    from policy.model import DENY_ALL
    from policy.suggest import JobAudit, merged_policy, utc_minute

    since = time.time() - args.since
    records = _job_records(args, since)
    if not records:
        raise UserError(f"no jobs of {args.repository} since {utc_minute(since)} in the job records: nothing to suggest "
                        "from (names are OWNER/NAME as `microvm-check jobs` shows them)")
    jobs = [JobAudit(rec.id, rec.created_at, tuple(rec.blocked_egress[:MAX_RECORDS_PER_JOB])) for rec in records]
    tried = sum(1 for job in jobs if job.records)
    blind = sum(1 for rec in records if rec.policy_digest == DENY_ALL.digest())
    header = (f"Suggested by `microvm-check policy suggest` from {len(jobs)} jobs of {args.repository} since "
              f"{utc_minute(since)}, {tried} of which tried egress their policy did not allow.\n"
              + (f"{blind} of them had no network card (their policy allowed nothing, in block mode), so nothing "
                 "they tried could be seen: run the repository with `mode: audit` to learn what it needs.\n"
                 if blind else "")
              + "Review it before adopting it: it allows what these jobs tried, nothing more.")
    print(merged_policy(jobs, header), end="")
    return 0


def _job_records(args: argparse.Namespace, since: float) -> list[JobRecord]:
    """The repository's records since `since`, read from the service's SQLite file (never created here)."""
    from runner.service.config.reading import ConfigError, load_config
    from runner.service.config.settings import DEFAULT_STATE_DIR, ServiceConfig
    from runner.service.jobs.records import RecordStore

    if args.config:
        try:
            path = load_config(args.config).records_path
        except ConfigError as exc:
            raise UserError(f"{args.config} is not a valid service config:\n{exc}") from None
    else:
        path = ServiceConfig(state_dir=args.state_dir or Path(DEFAULT_STATE_DIR)).records_path
    if not path.is_file():
        raise UserError(f"no job records at {path}: pass the service's --state-dir or --config")
    store = RecordStore(path)
    try:
        return store.of_repository(args.repository, since)
    finally:
        store.close()
