"""`microvm-check template list | rm` with derived templates (warm bases, snapshots)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from runner.vm.templates import LAST_USED, TemplateStore
from vmimages import cli


def _derived(store: TemplateStore, name: str, created: float, used: float) -> None:
    path = store.begin(name, "e" * 20)
    (path / "manifest.json").write_text(json.dumps({
        "name": name, "digest": "e" * 20, "accel": "tcg", "memory_mib": 512, "created": created,
        "variants": ["nonet"], "parent": {"name": "base", "digest": "f" * 20}}))
    (path / "nonet").mkdir()
    (path / "nonet" / "disk.img").write_bytes(os.urandom(3 << 20))
    store.publish(name, "e" * 20)
    os.utime(store.root / name / LAST_USED, (used, used))


def test_list_shows_size_age_and_last_use_and_rm_removes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MICROVM_CHECK_STATE", str(tmp_path))
    store = TemplateStore(tmp_path / "templates")
    now = time.time()
    _derived(store, "base--acme--app", now - 3 * 86400, now - 2 * 3600)
    assert cli.cmd_list(None) == 0
    line = capsys.readouterr().out.splitlines()[1].split()
    assert line[0] == "base--acme--app" and line[4:6] == ["3", "MiB"]
    assert line[6:8] == ["3d", "2h"] and line[8:] == ["base", "(nonet)"]
    assert cli.cmd_rm(type("Args", (), {"name": "base--acme--app", "yes": True})) == 0
    assert store.list() == []
    with pytest.raises(Exception, match="no template named 'base--acme--app'"):
        cli.cmd_rm(type("Args", (), {"name": "base--acme--app", "yes": True}))


def _main(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner.cli", *argv], capture_output=True, text=True, input=stdin,
                          timeout=120, env={**os.environ, "MICROVM_CHECK_STATE": "/nonexistent-mvc-state"})


def test_template_commands_use_the_configs_state_dir_and_rm_asks(tmp_path):
    """`--config F` means F's state_dir (not $MICROVM_CHECK_STATE or /var/lib): list and rm see what serve sees."""
    state = tmp_path / "state"
    config = tmp_path / "service.yml"
    config.write_text(f"state_dir: {state}\n")
    store = TemplateStore(state / "templates")
    _derived(store, "base--acme--app", time.time(), time.time())
    listed = _main("template", "list", "--config", str(config))
    assert listed.returncode == 0 and "base--acme--app" in listed.stdout, listed
    asked = _main("template", "rm", "base--acme--app", "--config", str(config), stdin="y\n")
    assert asked.returncode == 1 and "pass --yes when there is no terminal" in asked.stderr, asked
    assert [t.name for t in store.list()] == ["base--acme--app"]
    done = _main("template", "rm", "base--acme--app", "--config", str(config), "--yes")
    assert done.returncode == 0 and store.list() == [], done


def test_template_rm_on_a_terminal_removes_only_on_yes(tmp_path, monkeypatch):
    monkeypatch.setenv("MICROVM_CHECK_STATE", str(tmp_path))
    store = TemplateStore(tmp_path / "templates")
    _derived(store, "snap", time.time(), time.time())
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    answers = iter(["", "y"])
    monkeypatch.setattr("builtins.input", lambda _q: next(answers))
    args = argparse.Namespace(name="snap", yes=False, config=None)
    assert cli.cmd_rm(args) == 1 and [t.name for t in store.list()] == ["snap"]
    assert cli.cmd_rm(args) == 0 and store.list() == []
