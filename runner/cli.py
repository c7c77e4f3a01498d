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
import traceback
from importlib import metadata

from runner.errors import MicrovmCheckError

COMMAND_MODULES = (
    "vmimages.cli",  # template build | list | rm
    "runner.commands.doctor",  # doctor
    "runner.commands.policy",  # policy check | render | suggest
    "runner.service.cli",  # serve | run | jobs
    "runner.service.config_cli",  # config check | schema
    "runner.commands.github",  # register | deregister | runners | guard | redeliver
)


DESCRIPTION = """\
Run pull-request checks, forks included, in a fresh QEMU microVM per job on your own runner hosts.
A host service restores each VM from a snapshot, puts only the checkout inside, enforces the
repository's egress policy, streams the logs back and destroys the VM; the GitHub action hands it
the job. Start with `microvm-check doctor`."""
EPILOG = "`microvm-check COMMAND --help` shows a command's options."
BUG = ("microvm-check: this is a bug in microvm-check, not something you did: please report it with the "
       "traceback above and the command you ran")


def version() -> str:
    """The installed distribution's version: what `pip` and bug reports know this build as."""
    try:
        return metadata.version("microvm-check")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; run scripts/setup)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="microvm-check", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
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
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """`args.func(args)`'s exit status, and how an error it raises is shown: an error of the project's tree
    (runner/errors.py) as one line, since its message is complete; anything else as a bug, with its traceback."""
    try:
        return int(args.func(args) or 0)
    except MicrovmCheckError as exc:
        print(f"microvm-check: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:  # nothing explains it: shown whole, so it can be reported and fixed
        traceback.print_exc()
        print(BUG, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
