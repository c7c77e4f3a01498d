"""The `microvm-check` command: one entry point, each area registers its own subcommands.

Every area owns a `cli` module exposing `register(subparsers)`; it adds its subcommands with
`set_defaults(func=...)`, where `func(args) -> int` is the exit status. Keeping the wiring here
and the commands next to the code they drive lets each area change without touching the others.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from runner.errors import UserError

COMMAND_MODULES = (
    "vmimages.cli",  # template build | list | rm
    "runner.vm.cli",  # doctor
    "policy.cli",  # policy check | render
    "runner.service.cli",  # serve | run | jobs
    "runner.service.config_cli",  # config check | schema
    "runner.github.cli",  # register | deregister | runners | guard | redeliver
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microvm-check", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # an area that is not built yet
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"microvm-check: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
