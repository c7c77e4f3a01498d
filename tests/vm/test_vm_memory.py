"""doctor's accelerator line reports the PSS of the running VMs of its state directory, KVM and TCG apart,
measured from the real VMMs (runner.vm.memory)."""

from __future__ import annotations

import argparse
import re

from runner.commands import doctor
from runner.sandbox.port import VMRequest
from runner.vm import memory


def test_doctor_reports_the_pss_of_running_vms_by_accelerator(make_engine, tmp_path, monkeypatch, capsys) -> None:
    engine = make_engine(pool_size=0)
    assert memory.describe(engine.state.vms) == "PSS: kvm none running, tcg none running"
    vms = [engine.create(VMRequest()) for _ in range(2)]
    accel = vms[0].snapshot.config.accel
    found = memory.by_accel(engine.state.vms)
    assert list(found) == [accel] and found[accel].vms == 2
    own = [memory.pss_mib(vm.machine.pid) for vm in vms]
    assert all(p is not None and p > 1 for p in own), own
    assert abs(found[accel].pss_mib - sum(p for p in own if p) / 2) < 5  # the same processes, read again

    monkeypatch.setenv("MICROVM_CHECK_STATE", str(engine.state.root))
    doctor.cmd_doctor(argparse.Namespace(selftest=False, config=tmp_path / "no-service.yml"))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("accelerator:"))
    other = "tcg" if accel == "kvm" else "kvm"
    assert re.search(rf"PSS: .*{accel} \d+\.\d MiB per VM \(2 running\)", line), line
    assert f"{other} none running" in line, line
    for vm in vms:
        engine.destroy(vm)
    assert memory.by_accel(engine.state.vms) == {}
