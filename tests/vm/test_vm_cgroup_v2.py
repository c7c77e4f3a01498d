"""The cgroup v2 path on a fake cgroupfs tree: this host (and CI) mounts v1, so the v2 file formats and
the delegation chain are exercised here, against what the kernel documents (cgroup-v2.rst)."""

from __future__ import annotations

import os

import pytest

from runner.vm import cgroup
from runner.vm.errors import VMError


@pytest.fixture
def v2_root(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)
    return tmp_path


def test_v2_is_chosen_only_with_cpu_memory_and_pids(v2_root):
    assert cgroup.version() == "v2"
    (v2_root / "cgroup.controllers").write_text("cpu io hugetlb\n")
    assert cgroup.version() is None


def test_v2_vm_cgroup_delegates_controllers_down_the_chain_and_writes_the_limits(v2_root):
    limits = cgroup.limits_for(vcpus=2, memory_mib=512)
    group = cgroup.VMCgroup.create("scope1", "vm1", limits)
    assert group.version == "v2"
    assert group.paths == [v2_root / cgroup.PARENT / "scope1" / "vm1"]
    # a controller works in a cgroup only if every ancestor enables it for its children
    for ancestor in (v2_root, v2_root / cgroup.PARENT, v2_root / cgroup.PARENT / "scope1"):
        assert (ancestor / "cgroup.subtree_control").read_text().split() == ["+cpu", "+memory", "+pids"]
    vm = group.paths[0]
    assert (vm / "cpu.max").read_text() == "300000 100000"  # "$MAX $PERIOD": 3 CPUs' worth of time
    assert (vm / "memory.max").read_text() == str((512 + 512) << 20)  # bytes
    assert (vm / "pids.max").read_text() == "128"
    group.add(os.getpid())
    assert (vm / "cgroup.procs").read_text() == str(os.getpid())
    assert cgroup.groups("scope1") == [vm] and cgroup.groups("other") == []


def test_v2_second_vm_of_a_scope_reuses_the_chain_and_a_name_clash_is_an_error(v2_root):
    limits = cgroup.limits_for(vcpus=1, memory_mib=256)
    cgroup.VMCgroup.create("scope1", "vm1", limits)
    cgroup.VMCgroup.create("scope1", "vm2", limits)
    assert sorted(p.name for p in cgroup.groups("scope1")) == ["vm1", "vm2"]
    with pytest.raises(VMError, match="cannot create the VM's cgroup under .*scope1: .*File exists"):
        cgroup.VMCgroup.create("scope1", "vm1", limits)
