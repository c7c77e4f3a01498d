"""The derived templates' disk budget: least recently used first, never the base, never the one kept."""

from __future__ import annotations

import json
import os

import pytest

from runner.vm.templates import LAST_USED, TemplateStore


def _template(store: TemplateStore, name: str, mib: int, used_at: float, parent: str | None = "base") -> None:
    path = store.begin(name, "d" * 20)
    manifest = {"name": name, "digest": "d" * 20, "accel": "tcg", "memory_mib": 512, "created": used_at}
    if parent:
        manifest["parent"] = {"name": parent, "digest": "p" * 20}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "nonet").mkdir()
    (path / "nonet" / "mem.ram").write_bytes(os.urandom(mib << 20))  # real blocks: sizes count blocks
    store.publish(name, "d" * 20)
    os.utime(store.root / name / LAST_USED, (used_at, used_at))


@pytest.fixture
def store(tmp_path):
    return TemplateStore(tmp_path / "templates")


def test_evicts_least_recently_used_derived_templates_until_within_budget(store):
    _template(store, "base", 4, 100, parent=None)
    _template(store, "old", 2, 200)
    _template(store, "recent", 2, 400)
    _template(store, "middle", 2, 300)
    removed = store.evict(budget_bytes=3 << 20)  # derived templates only: the base is not counted
    assert removed == ["old", "middle"]
    assert [t.name for t in store.list()] == ["base", "recent"]  # the recipe-built base is never evicted


def test_a_restore_makes_a_template_recent(store):
    _template(store, "a", 1, 100)
    _template(store, "b", 1, 200)
    store.touch("a")
    assert store.evict(budget_bytes=(1 << 20) + (512 << 10)) == ["b"]


def test_the_kept_template_stays_even_over_budget(store):
    _template(store, "a", 2, 100)
    _template(store, "b", 2, 200)
    assert store.evict(budget_bytes=0, keep=frozenset({"a"})) == ["b"]
    assert [t.name for t in store.list()] == ["a"]


def test_a_template_without_a_variant_says_how_to_get_one(store):
    _template(store, "nic-less", 1, 100)
    path = store.root / "nic-less" / ("d" * 20) / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "cmdline": "", "vcpus": 1, "variants": ["nonet"]}))
    from runner.vm.templates import TemplateNotFound

    with pytest.raises(TemplateNotFound, match=r"without a network card: create the sandbox with network=False"):
        store.get("nic-less").snapshot(network=True)


def test_sandboxes_snapshots_are_neither_counted_nor_evicted(store):
    """A sandbox's snapshot lives as long as its sandboxes: the warm bases' budget does not touch it."""
    _template(store, "warm", 2, 300)
    _template(store, "sbx-j0123456789abcdef-1", 4, 100)
    path = store.root / "sbx-j0123456789abcdef-1" / ("d" * 20) / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sandbox": "j0123456789abcdef"}))
    assert store.evict(budget_bytes=3 << 20) == []  # 2 MiB of warm bases fit; the 4 MiB snapshot is not theirs
    assert store.evict(budget_bytes=0) == ["warm"]
    assert [t.name for t in store.list()] == ["sbx-j0123456789abcdef-1"]
