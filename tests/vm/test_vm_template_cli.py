"""`microvm-check template list | rm` with derived templates (warm bases, snapshots)."""

from __future__ import annotations

import json
import os
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
    assert cli.cmd_rm(type("Args", (), {"name": "base--acme--app"})) == 0
    assert store.list() == []
    with pytest.raises(Exception, match="no template named 'base--acme--app'"):
        cli.cmd_rm(type("Args", (), {"name": "base--acme--app"}))
