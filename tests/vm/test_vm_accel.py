"""Choosing the accelerator: a test boot is believed, /dev/kvm merely existing is not."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_pvm_backend_is_recognised_without_a_test_boot(monkeypatch):
    if not (Path("/sys/module/kvm_pvm").exists() and Path("/dev/kvm").exists()):
        pytest.skip("this host's /dev/kvm is not the PVM backend (the case PLATFORM.md describes)")
    monkeypatch.delenv("MICROVM_CHECK_ACCEL", raising=False)
    verdict = accel.static_checks()
    assert verdict is not None and verdict.name == "tcg" and "PVM" in verdict.reason


def test_forcing_an_accelerator(monkeypatch):
    monkeypatch.setenv("MICROVM_CHECK_ACCEL", "tcg")
    assert accel.static_checks() == accel.Accel("tcg", "forced by MICROVM_CHECK_ACCEL=tcg")
