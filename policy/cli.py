"""`microvm-check policy check|render`: lint policy files and show the rules a VM would get."""

from __future__ import annotations

import argparse
from pathlib import Path

from policy.load import PolicyError, load_policy
from policy.render import RenderContext, render
from runner.errors import UserError

# What `policy render` shows rules for: a typical VM namespace, so that the output reads like the real thing.
EXAMPLE_CONTEXT = RenderContext(
    guest_ip="172.16.0.2", guest_mac="52:54:00:12:34:56", gateway_ip="172.16.0.1",
    dns_ip="172.16.0.1", guest_ip6="fd00:16::2", log_prefix="mvc:example",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("policy", help="check and render egress policy files")
    commands = parser.add_subparsers(dest="policy_command", metavar="COMMAND", required=True)

    check = commands.add_parser("check", help="validate policy files; print every problem like a linter")
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")
    check.set_defaults(func=check_command)

    show = commands.add_parser("render", help="print the iptables-restore rules a VM would get")
    show.add_argument("file", type=Path, metavar="FILE")
    show.add_argument("--ipv6", action="store_true", help="print the ip6tables-restore document instead")
    show.set_defaults(func=render_command)


def check_command(args: argparse.Namespace) -> int:
    """Exit 0 when every file is valid, 1 otherwise, after printing all problems of all files."""
    failed = False
    for path in args.files:
        try:
            load_policy(path)
        except PolicyError as exc:
            failed = True
            print(exc)
    return 1 if failed else 0


def render_command(args: argparse.Namespace) -> int:
    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        raise UserError(f"{args.file} is not a valid policy:\n{exc}") from None
    rules = render(policy, EXAMPLE_CONTEXT)
    print(rules.ipv6 if args.ipv6 else rules.ipv4, end="")
    return 0
