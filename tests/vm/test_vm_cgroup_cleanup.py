"""Engines leave no cgroup directories behind: their own scope goes at close, and an engine's start-up sweep
removes the empty scopes of engines that crashed (before: 89 empty microvm-check/<scope> per controller)."""

from __future__ import annotations

import os
import uuid

from runner.sandbox.port import VMRequest
from runner.vm import cgroup


def test_an_engine_removes_its_own_cgroups_at_close(make_engine) -> None:
    engine = make_engine(pool_size=0)
    scope = cgroup.scope_for(engine.state.vms)
    vm = engine.create(VMRequest())
    assert cgroup.groups(scope) and all(p.is_dir() for p in cgroup.scope_paths(scope))
    engine.destroy(vm)
    assert cgroup.groups(scope) == []
    engine.close()
    assert [p for p in cgroup.scope_paths(scope) if p.exists()] == []
    for parent in (p.parent for p in cgroup.scope_paths(scope)):  # the shared parent goes with its last scope
        assert not parent.exists() or [e for e in parent.iterdir() if e.is_dir()], f"{parent} left empty"


def test_a_peers_scope_keeps_the_shared_parent(make_engine) -> None:
    engine = make_engine(pool_size=0)
    scope = cgroup.scope_for(engine.state.vms)
    engine.destroy(engine.create(VMRequest()))
    peers = [p.parent / ("peer" + uuid.uuid4().hex[:8]) for p in cgroup.scope_paths(scope)]
    try:
        for peer in peers:
            peer.mkdir()
        engine.close()
        assert all(peer.parent.is_dir() for peer in peers), "a peer's scope lost its parent"
    finally:
        for peer in peers:
            peer.rmdir()
            cgroup.remove_shared_parent(peer.parent)


def test_the_start_up_sweep_removes_empty_scopes_that_crashed_engines_left(make_engine) -> None:
    name = "dead" + uuid.uuid4().hex[:8]
    old, young, busy = (f"{name}{tag}" for tag in ("o", "y", "b"))
    parents = [p.parent for p in cgroup.scope_paths(name)]
    assert parents, "no cgroup hierarchy"
    made = []
    try:
        for parent in parents:
            parent.mkdir(exist_ok=True)
            for scope in (old, young, busy):
                (parent / scope).mkdir()
                made.append(parent / scope)
            (parent / busy / "vm").mkdir()  # a live engine's VM cgroup: never touched
            made.insert(0, parent / busy / "vm")
            for scope in (old, busy):
                os.utime(parent / scope, (1, 1))
        engine = make_engine(pool_size=0)
        for parent in parents:
            assert not (parent / old).exists(), "an old empty scope was left"
            assert (parent / young).is_dir(), "a scope an engine has just made was removed"
            assert (parent / busy / "vm").is_dir()
        engine.close()
    finally:
        for path in made:
            if path.exists():
                path.rmdir()
        for parent in parents:
            cgroup.remove_shared_parent(parent)
