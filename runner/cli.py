"""The `microvm-check` command: one entry point, each area registers its own subcommands.

Every area owns a `cli` module exposing `register(subparsers)`; it adds its subcommands with
`set_defaults(func=...)`, where `func(args) -> int` is the exit status. Keeping the wiring here
and the commands next to the code they drive lets each area change without touching the others.

Start-up imports only the area of the command being run (`COMMANDS` says which; `--version` and
`--help` import none): importing every area costs about 0.3 s, mostly the service and VM layers,
which `policy check` or `jobs` never use. tests/test_cli_top.py keeps `COMMANDS` equal to what
the areas register.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from runner import startup
from runner.errors import MicrovmCheckError

COMMAND_MODULES: tuple[str, ...] = (
    "vmimages.cli",  # template build | list | rm
    "runner.commands.doctor",  # doctor
    "runner.commands.policy",  # policy check | render | suggest
    "runner.service.host.cli",  # serve | jobs
    "runner.commands.localrun",  # run
    "runner.service.host.config_cli",  # config check | schema
    "runner.commands.github",  # register | deregister | runners | guard | redeliver
    "runner.commands.attestation",  # attestation | attestation-key | verify
)

# Each command, the module that registers it and its one-line help (for `--help` without importing it).
COMMANDS: dict[str, tuple[str, str]] = {
    "template": ("vmimages.cli", "build, list and remove VM templates"),
    "doctor": ("runner.commands.doctor", "check this host and say which accelerator VMs use"),
    "policy": ("runner.commands.policy", "check, render and suggest egress policies"),
    "serve": ("runner.service.host.cli", "run the job service (API on a Unix socket)"),
    "run": ("runner.commands.localrun", "run a command on a local checkout in a fresh VM"),
    "jobs": ("runner.service.host.cli", "list job records"),
    "config": ("runner.service.host.config_cli", "check service configs, print their JSON Schema"),
    "register": ("runner.commands.github", "register this host's runner with the org"),
    "deregister": ("runner.commands.github", "remove this host's runner from the org"),
    "runners": ("runner.commands.github", "list the org's runners, ours marked by label"),
    "redeliver": ("runner.commands.github", "ask GitHub to redeliver failed webhook deliveries"),
    "runner": ("runner.commands.github", "the ephemeral runners the service keeps (runners: section)"),
    "status": ("runner.commands.github", "the running service's VMs, spare pools, queue, jobs, runners"),
    "guard": ("runner.commands.github", "job-started hook: refuse untrusted fork workflows"),
    "attestation": ("runner.commands.attestation", "print a job's signed record (a DSSE envelope line)"),
    "attestation-key": ("runner.commands.attestation", "print the public key the service signs job records with"),
    "verify": ("runner.commands.attestation", "check a signed job record and its artifacts"),
}

DESCRIPTION = """\
Run pull-request checks, forks included, in a fresh QEMU microVM per job on your own runner hosts.
A host service restores each VM from a snapshot, puts only the checkout inside, enforces the
repository's egress policy, streams the logs back and destroys the VM; the GitHub action hands it
the job. Start with `microvm-check doctor`."""
EPILOG = "`microvm-check COMMAND --help` shows a command's options."
BUG = ("microvm-check: this is a bug in microvm-check, not something you did: please report it with the "
       "traceback above and the command you ran")


_DIST_INFO_PREFIX = "microvm_check-"


def version() -> str:
    """The installed distribution's version: what `pip` and bug reports know this build as.

    Read from the name of its `.dist-info` directory on sys.path (`NAME-VERSION.dist-info`, as installers
    name it), which is a directory listing; importlib.metadata, the fallback, costs 25-200 ms of start-up."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith(_DIST_INFO_PREFIX) and name.endswith(".dist-info"):
                return name[len(_DIST_INFO_PREFIX):-len(".dist-info")]
    from importlib import metadata

    try:
        return metadata.version("microvm-check")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; run scripts/setup)"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse measures the command names at their group's indent but prints them one step deeper, so the
    longest name (attestation-key) would get its help on a line of its own: measure them where they are printed."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):
            self._action_max_length += self._indent_increment


class _Version(argparse.Action):
    """`--version`, reading the version only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with `command`'s area registered in full and every other command as a name and
    help line only (None: every area in full, as a test or a caller that wants them all needs)."""
    parser = argparse.ArgumentParser(prog="microvm-check", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details to stderr")
    parser.add_argument("--debug", action="store_true",
                        help="as -v, and show the traceback of an error too (for a bug report)")
    parser.add_argument("--version", action=_Version)
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    modules: tuple[str, ...]
    if command is None:
        modules = COMMAND_MODULES
    elif command in COMMANDS:
        modules = (COMMANDS[command][0],)
    else:
        modules = COMMAND_MODULES if command not in ("-h", "--help") else ()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # an area that is not built yet
        module.register(subparsers)
    for name, (_, summary) in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=summary, add_help=False)  # a name for --help; never parsed
    return parser


def _command_word(argv: list[str]) -> str | None:
    """The command named in `argv` (the top-level options take no value), or None."""
    for arg in argv:
        if arg in ("-h", "--help") or not arg.startswith("-"):
            return arg
    return None


def entry() -> int:
    """The installed command (and `python -I -m runner.cli`, as the host starts it): `main` as a program of
    its own, whose start-up objects (the command's area, imported) the cyclic garbage collector leaves alone
    (runner/startup.py)."""
    startup.begin()
    return main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_word(argv) or "--help")
    args = parser.parse_args(argv)
    startup.settled()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose or args.debug else logging.WARNING,
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
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"microvm-check: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C; a command that turns SIGTERM/SIGHUP into one sets its signum
        return 128 + int(getattr(exc, "signum", 2))
    except Exception:  # nothing explains it: shown whole, so it can be reported and fixed
        traceback.print_exc()
        print(BUG, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(entry())
