"""`microvm-check doctor` on a host without a template."""

from __future__ import annotations

import argparse

from runner.vm import accel, cli


def test_selftest_without_a_template_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MICROVM_CHECK_STATE", str(tmp_path / "state"))
    monkeypatch.setattr(accel, "static_checks", lambda: None)  # only a test boot could tell
    monkeypatch.setattr(accel, "selftest", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no boot without a template")))
    assert cli.cmd_doctor(argparse.Namespace(selftest=True)) == 1
    out = capsys.readouterr().out
    assert "accelerator: cannot test-boot the guest:" in out and "base" in out
