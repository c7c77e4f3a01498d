"""`microvm-check config check FILE... | schema`: check service configs without starting anything.

An operator (or a configuration-management hook) can validate a config before `serve` reads it;
the same loader runs, so a file that passes here starts, and one that fails lists every problem.
A good file's lines after `ok FILE` say what binds its runners' jobs (runner/service/host/binding.py),
which the config decides and nothing in it names outright, and then the secret bindings file the config
names, read as `serve` reads it (its problems at file:line, its value files root's only; no value shown).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.service.config.reading import ConfigError, load_config
from runner.service.config.schema import schema_text
from runner.service.host.binding import runner_binding
from runner.service.jobs.secretbindings import load_secrets


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = subparsers.add_parser("config", help="check service configs, print their JSON Schema")
    commands = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = commands.add_parser("check", help="check service config files: 'ok FILE' or every problem")
    check.add_argument("files", nargs="+", type=Path, metavar="FILE")
    check.set_defaults(func=cmd_check)
    schema = commands.add_parser("schema", help="print the service config's JSON Schema (for editors)")
    schema.set_defaults(func=cmd_schema)


def cmd_check(args: argparse.Namespace) -> int:
    """Every file is checked, even after a bad one; the status is 1 when any had a problem."""
    status = 0
    for path in args.files:
        try:
            config = load_config(path)
            secrets = load_secrets(config.secrets)  # as `serve` reads it: file:line problems, root-only values
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            status = 1
        else:
            print(f"ok {path}")
            for line in runner_binding(config):
                print(f"  {line}")
            if config.secrets is not None:
                print(f"  secret bindings: {len(secrets.bindings)} in {config.secrets} "
                      f"({', '.join(sorted(secrets.names)) or 'none'})")
            if config.recipes is not None and not _recipes_ok(config.recipes):
                status = 1
    return status


def _recipes_ok(directory: Path) -> bool:
    """The operator's recipes, read as `template build` reads them: every problem at its file:line."""
    from vmimages.recipebook import check_dir, names  # the recipe file's own reader (no build machinery)

    if not directory.is_dir():
        print(f"{directory}: recipes: names no directory; make it, or remove recipes: from the config",
              file=sys.stderr)
        return False
    problems = check_dir(directory)
    for problem in problems:
        print(problem, file=sys.stderr)
    own = sorted(p.stem for p in directory.glob("*.yml"))
    print(f"  recipes: {len(own)} in {directory} ({', '.join(own) or 'none'}); all templates: "
          f"{', '.join(sorted(names(directory)))}")
    return not problems


def cmd_schema(args: argparse.Namespace) -> int:
    sys.stdout.write(schema_text())
    return 0
