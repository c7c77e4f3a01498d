"""Template recipes, the store, and the `template` commands (no VM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cli import main
from runner.sandbox.port import VMRequest
from runner.vm import guestwire as P
from runner.vm.templates import TemplateNotFound, TemplateStore, stale_agent
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


def baked(root: Path, name: str, agent_ops: list[str] | None, parent: str | None = None) -> TemplateStore:
    """A template as `template build` (or `Engine.snapshot`, with `parent`) leaves it, its agent's operations
    recorded as given (None: a template baked before they were); a rebuild of `name` replaces it."""
    import shutil

    shutil.rmtree(root / name, ignore_errors=True)
    fake_template(root, name, "d" * 20)
    path = root / name / ("d" * 20) / "manifest.json"
    manifest = {**json.loads(path.read_text()), "hypervisor_version": "QEMU 7.2"}
    if agent_ops is not None:
        manifest["agent_ops"] = agent_ops
    if parent is not None:
        manifest |= {"parent": {"name": parent, "digest": "e" * 20}, "variants": ["nonet"]}
    path.write_text(json.dumps(manifest))
    store = TemplateStore(root)
    store.publish(name, "d" * 20)
    return store


def test_a_template_whose_agent_lacks_an_operation_is_named_with_its_fix(tmp_path: Path):
    store = baked(tmp_path, "base", sorted(P.OPS))
    assert stale_agent(store.get("base")) is None
    store = baked(tmp_path, "base", sorted(P.OPS - {P.QUIESCE}))
    assert stale_agent(store.get("base")) == (
        f"template 'base' ({'d' * 20}) was baked with a guest agent older than this host: it lacks 'quiesce', which "
        "this host sends: rebuild it with 'microvm-check template build base'")
    store = baked(tmp_path, "base.large", None)
    assert stale_agent(store.get("base.large"), config="/etc/mvc.yml") == (
        f"template 'base.large' ({'d' * 20}) was baked with a guest agent older than this host: its manifest records "
        "none of the operations the agent answers (agent_ops): rebuild it with "
        "'microvm-check template build base --size large --config /etc/mvc.yml'")
    store = baked(tmp_path, "base--net--octo--repo", None, parent="base")
    assert stale_agent(store.get("base--net--octo--repo")).endswith(
        "(its agent is that of 'base', which it was made from): rebuild 'base' with 'microvm-check template build "
        "base', then make 'base--net--octo--repo' again from it (a repository's warm base is remade by itself when "
        "its parent changes)")


class QemuOfTheManifests:
    name = "qemu"

    def version(self) -> str:
        return "QEMU 7.2"


def test_the_engine_never_restores_a_template_whose_agent_is_older(tmp_path: Path):
    """Refused before any VM is spawned, with the fix: not a job that fails later at its first snapshot."""
    from runner.vm.engine import Engine
    from runner.vm.errors import SandboxError
    from runner.vm.statedir import StateDir

    store = baked(tmp_path / "templates", "base", sorted(P.OPS - {P.QUIESCE}))
    engine = Engine(StateDir(tmp_path / "state"), templates=store, hypervisor=QemuOfTheManifests(), pool_size=0)
    try:
        with pytest.raises(SandboxError, match="^template 'base' .* lacks 'quiesce'.*template build base'$"):
            engine.create(VMRequest())
        assert engine.live() == [] and [p.name for p in engine.state.vms.iterdir()] == [".engine.lock"]
        baked(tmp_path / "templates", "base", sorted(P.OPS))
        assert engine.template("base").agent_ops == P.OPS
    finally:
        engine.close()


def test_an_agent_answering_unknown_op_to_quiesce_fails_the_snapshot_naming_the_template(tmp_path: Path):
    """A template whose manifest claims more than its agent serves (copied by hand, say), or a guest that
    says so after running a job's code: the snapshot fails naming both, the template and its fix among
    them, the VM runs on, nothing of the new template is left."""
    import socket
    import threading

    from runner.vm.agent import AgentClient
    from runner.vm.engine import Engine
    from runner.vm.errors import SandboxError
    from runner.vm.statedir import StateDir
    from runner.vm.vm import VM
    from tests.vm.test_vm_engine_units import FakeMachine

    store = baked(tmp_path / "templates", "base", sorted(P.OPS))
    engine = Engine(StateDir(tmp_path / "state"), templates=store, hypervisor=QemuOfTheManifests(), pool_size=0)
    host, guest = socket.socketpair()

    def old_agent() -> None:
        request = P.FrameReader(guest.recv).next()
        guest.sendall(P.encode_msg(request.request_id, {"ok": False, "error": "unknown op 'quiesce'"}))

    threading.Thread(target=old_agent, daemon=True).start()
    (tmp_path / "vm").mkdir()
    vm = VM(id="vm1", dir=tmp_path / "vm", machine=FakeMachine(), snapshot=store.get("base").snapshot(False))
    vm.agent = AgentClient(host)
    try:
        with pytest.raises(SandboxError, match="^could not quiesce VM vm1 for its snapshot: its guest answered that "
                                               "it does not know 'quiesce'. Either the code this VM ran \\(untrusted\\) "
                                               "made it answer so, or template 'base' .* it "
                                               "lacks 'quiesce', which this host sends: rebuild it with 'microvm-check "
                                               "template build base'$"):
            engine.snapshot(vm, "with-deps", quiet_s=0)
        assert vm.agent.broken is None and not vm.destroyed
        assert not (tmp_path / "templates" / "with-deps").exists() or not any(
            (tmp_path / "templates" / "with-deps").iterdir())
    finally:
        vm.agent.close()
        guest.close()
        host.close()
        engine.close()
