"""Choosing the accelerator: a test boot is believed, /dev/kvm merely existing is not."""

from __future__ import annotations

import os
from pathlib import Path

from runner.vm import accel


def test_a_test_boot_that_reaches_user_space_passes(template_store):
    template = template_store.get("base")
    ok, why = accel.selftest("qemu-system-x86_64", template.path / "vmlinuz", template.path / "initrd.img", "tcg")
    assert ok, why


def test_a_test_boot_that_never_reaches_user_space_fails(template_store, tmp_path: Path):
    template = template_store.get("base")
    empty = tmp_path / "empty-initrd"
    empty.write_bytes(b"")  # the kernel boots but finds no init: no marker on the console
    ok, why = accel.selftest("qemu-system-x86_64", template.path / "vmlinuz", empty, "tcg", timeout=30)
    assert not ok and "failed" in why


def _fake_host(monkeypatch, pvm: bool, cpu_flags: set[str]) -> None:
    """A host whose /dev/kvm exists and is usable, with or without the kvm_pvm module, on any real host."""
    real_exists, real_access = os.path.exists, os.access
    monkeypatch.setattr(accel.os.path, "exists", lambda p: str(p) == "/dev/kvm" or real_exists(p))
    monkeypatch.setattr(accel.os, "access", lambda p, mode: str(p) == "/dev/kvm" or real_access(p, mode))

    class FakePath(type(Path())):
        def exists(self, *args, **kwargs) -> bool:
            if str(self) == "/sys/module/kvm_pvm":
                return pvm
            return super().exists(*args, **kwargs)

    monkeypatch.setattr(accel, "Path", FakePath)
    monkeypatch.setattr(accel, "_cpu_flags", lambda: set(cpu_flags))
    monkeypatch.delenv("MICROVM_CHECK_ACCEL", raising=False)


def test_pvm_backend_is_recognised_without_a_test_boot(monkeypatch):
    # Faked, so that it runs on every host, not only on the PVM hosts docs/platform.md describes; the CPU
    # flags say vmx, so only the kvm_pvm marker can make this TCG.
    _fake_host(monkeypatch, pvm=True, cpu_flags={"vmx", "sse2"})
    verdict = accel.static_checks()
    assert verdict is not None and verdict.name == "tcg" and "PVM" in verdict.reason


def test_without_the_pvm_marker_a_vmx_host_needs_a_test_boot(monkeypatch):
    _fake_host(monkeypatch, pvm=False, cpu_flags={"vmx", "sse2"})
    assert accel.static_checks() is None


def test_forcing_an_accelerator(monkeypatch):
    monkeypatch.setenv("MICROVM_CHECK_ACCEL", "tcg")
    assert accel.static_checks() == accel.Accel("tcg", "forced by MICROVM_CHECK_ACCEL=tcg")
