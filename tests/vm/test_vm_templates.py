"""Template recipes, the store, and the `template` commands (no VM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cli import main
from runner.vm.templates import TemplateNotFound, TemplateStore
from vmimages.recipe import Recipe, RecipeError


def fake_template(root: Path, name: str, digest: str) -> None:
    path = root / name / digest
    for variant in ("net", "nonet"):
        (path / variant).mkdir(parents=True)
        (path / variant / "mem.ram").write_bytes(b"\0" * 4096)
    manifest = {"name": name, "digest": digest, "cmdline": "console=ttyS0", "memory_mib": 512, "vcpus": 1,
                "accel": "tcg", "created": 1_700_000_000.0}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_the_digest_follows_everything_that_goes_into_a_template():
    recipe = Recipe.load("base")
    base = recipe.digest("linux-image-6.1.0-57-amd64", "tcg", "QEMU 7.2", ["-M", "pc"])
    assert base == recipe.digest("linux-image-6.1.0-57-amd64", "tcg", "QEMU 7.2", ["-M", "pc"])
    assert base != recipe.digest("linux-image-6.1.0-58-amd64", "tcg", "QEMU 7.2", ["-M", "pc"])
    assert base != recipe.digest("linux-image-6.1.0-57-amd64", "kvm", "QEMU 7.2", ["-M", "pc"])
    assert base != recipe.digest("linux-image-6.1.0-57-amd64", "tcg", "QEMU 8.0", ["-M", "pc"])
    assert base != recipe.digest("linux-image-6.1.0-57-amd64", "tcg", "QEMU 7.2", ["-M", "q35"])
    bigger = Recipe(**{**recipe.__dict__, "memory_mib": 1024})
    assert base != bigger.digest("linux-image-6.1.0-57-amd64", "tcg", "QEMU 7.2", ["-M", "pc"])


def test_an_unknown_recipe_names_the_known_ones():
    with pytest.raises(RecipeError, match="known: base"):
        Recipe.load("nope")


def test_publish_switches_atomically_and_drops_older_builds(tmp_path: Path):
    store = TemplateStore(tmp_path)
    fake_template(tmp_path, "base", "aaa")
    store.publish("base", "aaa")
    fake_template(tmp_path, "base", "bbb")
    store.publish("base", "bbb")
    assert store.get("base").digest == "bbb"
    assert not (tmp_path / "base" / "aaa").exists()
    snapshot = store.get("base").snapshot(network=False)
    assert snapshot.mem_file == tmp_path / "base" / "bbb" / "nonet" / "mem.ram"
    assert snapshot.config.network is False and snapshot.config.memory_mib == 512


def test_template_list_and_rm_commands(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("MICROVM_CHECK_STATE", str(tmp_path))
    fake_template(tmp_path / "templates", "base", "abc123")
    TemplateStore(tmp_path / "templates").publish("base", "abc123")
    assert main(["template", "list"]) == 0
    out = capsys.readouterr().out
    assert "base" in out and "abc123" in out and "tcg" in out
    assert main(["template", "rm", "base", "--yes"]) == 0
    with pytest.raises(TemplateNotFound, match="no template named 'base' in .*: build it with 'microvm-check template build base'"):
        TemplateStore(tmp_path / "templates").get("base")
    assert main(["template", "rm", "base", "--yes"]) == 1
    assert "no template named 'base'" in capsys.readouterr().err
