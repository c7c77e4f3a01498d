"""One template store, several processes: builds, publishes, removals and VMs of one name beside each other.

flock is per open file description, so two `TemplateStore`s in one process hold their locks against each
other exactly as two processes do; the tests use that, and real subprocesses where a process ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from runner.errors import TemplateError
from runner.vm.templates import LOCKS, TemplateNotFound, TemplateStore


def build(store: TemplateStore, name: str, digest: str) -> Path:
    """Begin a build of `name` and write what a finished one has (its manifest, a variant), unpublished."""
    path = store.begin(name, digest)
    (path / "nonet").mkdir()
    (path / "nonet" / "mem.ram").write_bytes(b"\0" * 4096)
    manifest = {"name": name, "digest": digest, "cmdline": "console=ttyS0", "memory_mib": 512, "vcpus": 1,
                "accel": "tcg", "created": time.time()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def digests(root: Path, name: str) -> list[str]:
    return sorted(entry.name for entry in (root / name).iterdir() if entry.is_dir())


def test_two_builds_of_one_name_beside_each_other_end_with_one_good_current(tmp_path: Path) -> None:
    ours, theirs = TemplateStore(tmp_path), TemplateStore(tmp_path)
    build(ours, "base", "aaa")
    build(theirs, "base", "bbb")

    theirs.publish("base", "bbb")  # used to delete every other digest: our build under way with them
    assert digests(tmp_path, "base") == ["aaa", "bbb"] and (tmp_path / "base" / "aaa" / "manifest.json").exists()

    ours.publish("base", "aaa")  # theirs is published, and no one restores from it: it goes
    assert ours.get("base").digest == "aaa" and digests(tmp_path, "base") == ["aaa"]
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == ["aaa", "current", "last-used"]  # no temporary left


def test_a_build_of_the_same_digest_under_way_elsewhere_is_refused_not_deleted(tmp_path: Path) -> None:
    ours, theirs = TemplateStore(tmp_path), TemplateStore(tmp_path)
    path = build(theirs, "base", "aaa")

    with pytest.raises(TemplateError, match="being built, or VMs run from it, in another process"):
        ours.begin("base", "aaa")

    assert (path / "manifest.json").exists()
    theirs.publish("base", "aaa")
    assert ours.get("base").digest == "aaa"


def test_an_abandoned_build_goes_and_lets_the_digest_be_built_again(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path)
    build(store, "base", "aaa")
    store.abandon("base", "aaa")
    assert sorted(p.name for p in tmp_path.rglob("*")) == [LOCKS]  # neither the name nor its lock is left
    build(TemplateStore(tmp_path), "base", "aaa")  # nothing holds it any more


def test_a_held_digest_survives_a_newer_publish_and_goes_once_let_go(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path)
    build(store, "base", "aaa")
    store.publish("base", "aaa")
    hold = store.hold(store.get("base").path)  # what an engine takes before restoring from it

    build(store, "base", "bbb")
    TemplateStore(tmp_path).publish("base", "bbb")
    assert digests(tmp_path, "base") == ["aaa", "bbb"]

    hold.close()
    assert store.collect("base") == ["aaa"]
    assert digests(tmp_path, "base") == ["bbb"]
    with pytest.raises(TemplateNotFound, match="removed by another process"):
        store.hold(tmp_path / "base" / "aaa")


def test_removing_a_template_in_use_elsewhere_waits_for_its_last_user(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path)
    build(store, "snap", "aaa")
    store.publish("snap", "aaa")
    hold = store.hold(store.get("snap").path)

    TemplateStore(tmp_path).remove("snap")
    with pytest.raises(TemplateNotFound):
        store.get("snap")  # no new restore from it ...
    assert digests(tmp_path, "snap") == ["aaa"]  # ... but the files of the VMs running from it stay

    hold.close()
    store.collect("snap")
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCKS]


def test_a_digest_held_by_another_process_goes_when_that_process_dies(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path)
    build(store, "base", "aaa")
    store.publish("base", "aaa")
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                               "from runner.vm.templates import TemplateStore; "
                               "hold = TemplateStore(Path(sys.argv[1])).hold(Path(sys.argv[2])); "
                               "print('held', flush=True); sys.stdin.read()", str(tmp_path), str(tmp_path / "base" / "aaa")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        build(store, "base", "bbb")
        store.publish("base", "bbb")
        assert digests(tmp_path, "base") == ["aaa", "bbb"]
    finally:
        holder.communicate("")
    assert store.collect("base") == ["aaa"]


@pytest.mark.vm
def test_a_digest_an_engine_runs_a_vm_from_survives_another_publish_until_the_vm_ends(make_engine, template_store) -> None:
    """The engine holds the digest of every VM it runs; spares of a digest no longer current are ended (no one
    takes them), and once the last VM ends the digest goes (the reaper lets go of it)."""
    from runner.sandbox import Sandbox

    name = f"held-{uuid.uuid4().hex[:8]}"
    base = template_store.get("base")
    copy = template_store.begin(name, base.digest)
    try:
        for source in base.path.rglob("*"):
            target = copy / source.relative_to(base.path)
            if source.is_dir():
                target.mkdir()
            elif source.is_file():
                os.link(source, target)  # the same files, under a name of the test's own
        template_store.publish(name, base.digest)
        engine = make_engine(pool_size=1)  # a spare of it too, refilled after the create
        with Sandbox.create(template=name, engine=engine) as sandbox:
            deadline = time.monotonic() + 30
            while not engine.pool.ready().get(f"{name}/nonet") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.pool.ready().get(f"{name}/nonet") == 1
            other = TemplateStore(template_store.root)
            build(other, name, "newer")
            other.publish(name, "newer")
            assert copy.exists()
            assert sandbox.exec(["true"]).exit_code == 0  # its VM still runs

        deadline = time.monotonic() + 10
        while copy.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not copy.exists()
    finally:
        template_store.abandon(name, base.digest)
        TemplateStore(template_store.root).remove(name)
