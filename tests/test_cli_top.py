"""The top-level `microvm-check` command: what a first-time user sees of `--help` and `--version`."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runner.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_projects(capsys: pytest.CaptureFixture[str]) -> None:
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"microvm-check {expected}\n"


def test_help_says_what_the_tool_does_and_lists_every_command_on_one_line(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert text.split("\n\n")[1] == (
        "Run pull-request checks, forks included, in a fresh QEMU microVM per job on your own runner hosts.\n"
        "A host service restores each VM from a snapshot, puts only the checkout inside, enforces the\n"
        "repository's egress policy, streams the logs back and destroys the VM; the GitHub action hands it\n"
        "the job. Start with `microvm-check doctor`.")
    assert "one entry point" not in text and "registers" not in text  # the code's description is not the tool's
    assert text.rstrip().endswith("`microvm-check COMMAND --help` shows a command's options.")
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = {line.split()[0]: line.split(None, 1)[1] for line in text.split("commands:\n", 1)[1].splitlines()
              if line.startswith("    ") and len(line.split()) > 1}
    assert set(listed) == set(commands.choices)
    assert listed["policy"] == "check, render and suggest egress policies"
    assert listed["doctor"] == "check this host and say which accelerator VMs use"


def test_the_command_table_is_what_the_areas_register() -> None:
    """`COMMANDS` (what start-up reads instead of importing every area) names each command's module and help."""
    from runner.cli import COMMAND_MODULES, COMMANDS

    registered: dict[str, tuple[str, str]] = {}
    for name in COMMAND_MODULES:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        importlib.import_module(name).register(sub)
        registered |= {a.dest: (name, a.help) for a in sub._choices_actions}
    assert registered == COMMANDS


_PROBE = """
import json, sys
from runner.cli import main
try:
    main(sys.argv[2:])
except SystemExit:
    pass
open(sys.argv[1], "w").write(json.dumps(sorted(sys.modules)))
"""
# What no start-up of these commands may import: the service, the VM and network layers, GitHub.
HEAVY = ("runner.service.host.assembly", "runner.service.jobs.service", "runner.service.config.settings",
         "runner.vm", "runner.net", "runner.github", "runner.fleet", "vmimages")


@pytest.mark.parametrize(("argv", "also_not"), [
    (["--version"], ("policy", "httpx", "yaml", "runner.jobapi")),
    (["--help"], ("policy", "httpx", "yaml", "runner.jobapi")),
    (["policy", "check", "{policy}"], ("httpx", "runner.jobapi.client")),
    (["jobs", "--socket", "{tmp}/no.sock"], ("policy",)),
])
def test_start_up_imports_only_the_chosen_commands_area(argv: list[str], also_not: tuple[str, ...],
                                                        tmp_path: Path) -> None:
    policy = tmp_path / "p.yml"
    policy.write_text("version: 1\nmode: block\n")
    out = tmp_path / "modules.json"
    argv = [a.format(policy=policy, tmp=tmp_path) for a in argv]
    subprocess.run([sys.executable, "-c", _PROBE, str(out), *argv], cwd=ROOT, capture_output=True, timeout=60,
                   check=False)
    modules = json.loads(out.read_text())
    assert "runner.cli" in modules
    heavy = [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY + also_not)]
    assert heavy == []


_ENTRY_PROBE = """
import gc
import runner.cli as cli
seen = {}
def look(args):
    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
    return 0
cli.run_command = look
status = cli.entry()
print(seen["enabled"], seen["frozen"] > 10000, status)
"""


def test_the_installed_command_runs_with_its_start_up_frozen_and_the_collector_on(tmp_path: Path) -> None:
    """`entry` (the console script, `python -I -m runner.cli`): the imported area is frozen out of the collector's
    walks (start-up and exit time), and the command itself runs with collection on; `main` in a caller's
    process (this one) changes nothing of its collector."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["microvm-check"] == "runner.cli:entry"
    policy = tmp_path / "p.yml"
    policy.write_text("version: 1\nmode: block\n")
    done = subprocess.run([sys.executable, "-I", "-c", _ENTRY_PROBE, "policy", "check", str(policy)], cwd=ROOT,
                          capture_output=True, timeout=60, check=True)
    assert done.stdout.decode().split() == ["True", "True", "0"]
    before = gc.get_freeze_count()
    assert main(["policy", "check", str(policy)]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == before


_LONG_LIVED_PROBE = """
import gc
from runner import startup
with startup.long_lived():
    outside = gc.isenabled(), gc.get_freeze_count()
startup.begin()
startup.settled()
before = gc.get_freeze_count()
with startup.long_lived():
    inside = gc.isenabled()
    kept = [[n] for n in range(50000)]
print(outside == (True, 0), inside, gc.isenabled(), gc.get_freeze_count() - before >= 50000)
"""


def test_a_programs_long_lived_block_is_frozen_and_elsewhere_nothing_changes() -> None:
    """`startup.long_lived` (the in-process service of `run`): in the command's own process the block runs with
    the collector off and what it made is frozen after; in any other process (before `begin`) it changes nothing."""
    done = subprocess.run([sys.executable, "-c", _LONG_LIVED_PROBE], cwd=ROOT, capture_output=True, timeout=60,
                          check=True)
    assert done.stdout.decode().split() == ["True", "False", "True", "True"]
