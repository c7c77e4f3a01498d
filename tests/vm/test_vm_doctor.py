"""`microvm-check doctor` on a host without a template."""

from __future__ import annotations

import argparse
import grp
import os
import socket
from pathlib import Path

import pytest

from runner.commands import doctor as cli
from runner.vm import accel


def test_selftest_without_a_template_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MICROVM_CHECK_STATE", str(tmp_path / "state"))
    monkeypatch.setattr(accel, "static_checks", lambda: None)  # only a test boot could tell
    monkeypatch.setattr(accel, "selftest", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no boot without a template")))
    assert cli.cmd_doctor(argparse.Namespace(selftest=True, config=tmp_path / "service.yml")) == 1
    out = capsys.readouterr().out
    assert "accelerator: cannot test-boot the guest:" in out and "base" in out


def test_forwarding_on_or_able_to_be_turned_on(tmp_path: Path) -> None:
    forward = tmp_path / "ip_forward"
    forward.write_text("1\n")
    assert cli.network_checks(forward)[0] == cli.Check(True, "IP forwarding is on")
    missing = tmp_path / "no" / "ip_forward"
    assert cli.network_checks(missing)[0] == cli.Check(
        False, "IP forwarding is off; the service turns it on when network.enabled is true",
        f"make {missing} writable (run as root, not in a read-only /proc)")


def test_iptables_with_nflog(need_root) -> None:
    assert cli.network_checks()[1] == cli.Check(True, "iptables loads rules with the NFLOG target (audit mode)",
                                                "; install iptables and use a kernel with nfnetlink_log")


def test_the_service_config_is_checked_by_the_config_loader(tmp_path: Path) -> None:
    config = tmp_path / "service.yml"
    assert cli.service_checks(config) == [cli.Check(
        False, f"service config {config} exists",
        "write one (README: 'Install on a runner host') or name it with --config FILE")]
    config.write_text("max_concurrent_jobs: 0\nsokcet: /x\n")
    (check,) = cli.service_checks(config)
    assert (check.ok, check.what) == (False, f"service config {config} is valid")
    assert check.fix == (f"2 problem(s), first: {config}:1:22: max_concurrent_jobs: must be at least 1, not 0; "
                         f"`microvm-check config check {config}` lists them all")


def test_the_socket_and_its_group(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    config = tmp_path / "service.yml"
    config.write_text(f"socket: {path}\nsocket_group: no-such-group-mvc\n")
    assert cli.service_checks(config) == [
        cli.Check(True, f"service config {config} is valid"),
        cli.Check(False, "socket_group no-such-group-mvc exists",
                  "create it (groupadd no-such-group-mvc) and add the runner's user to it"),
        cli.Check(True, f"job API socket {path}: not there yet; `serve` creates it")]
    other = next(g for g in grp.getgrall() if g.gr_gid != os.getegid())
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        assert cli.socket_checks(str(path), other.gr_name)[1] == cli.Check(
            False, f"job API socket {path} belongs to group {other.gr_name}",
            "restart the service, which sets the group at start")
        os.chmod(path, 0o660)
        own = grp.getgrgid(os.getegid()).gr_name
        assert cli.socket_checks(str(path), own)[1] == cli.Check(True, f"job API socket {path} is there (mode 660)")


@pytest.mark.parametrize("oks, line", [((True, True), "doctor: all 2 checks passed"),
                                       ((True, False, False), "doctor: 1 of 3 checks passed, 2 to fix (marked NO above)")])
def test_the_summary_line(oks: tuple[bool, ...], line: str) -> None:
    assert cli.summary([cli.Check(ok, "x") for ok in oks]) == line


def _rsa_pem() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def test_doctor_config_checks_what_that_config_uses(tmp_path, monkeypatch, capsys):
    """--config F: F's state_dir and templates (not the default root, where 'base' may well be built), the files
    F names read as the service reads them, and the groups it names."""
    monkeypatch.setattr(accel, "static_checks", lambda: accel.Accel("tcg", "not what this test is about"))
    state = tmp_path / "state"
    good_key, bad_key = tmp_path / "app.pem", tmp_path / "bad.pem"
    good_key.write_text(_rsa_pem())
    bad_key.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    (tmp_path / "good.yml").write_text(f"app_id: 1\nprivate_key_path: {good_key}\n")
    (tmp_path / "bad.yml").write_text(f"app_id: 1\nprivate_key_path: {bad_key}\n")
    config = tmp_path / "service.yml"
    config.write_text(f"state_dir: {state}\ntemplates: [base, big]\nsocket: {tmp_path}/api.sock\n"
                      "sizes: {large: {vcpus: 2}}\n"
                      f"admin_group: no-such-group-mvc\ngithub_config: {tmp_path}/good.yml\n"
                      f"webhook: {{secret_path: {tmp_path}/missing-secret, github_config: {tmp_path}/bad.yml}}\n")
    assert cli.cmd_doctor(argparse.Namespace(selftest=False, config=config)) == 1
    out = capsys.readouterr().out
    for name in ("base", "big"):
        assert f"NO  template '{name}' is built in {state}: no template named '{name}'" in out
        assert f"build it with 'microvm-check template build {name}'" in out
        # each offered template at each offered size is a template of its own, and says how it is made
        assert (f"NO  template '{name}.large' is built in {state}: no template named '{name}.large'" in out
                and f"'microvm-check template build {name} --size large --config <the service config>'" in out)
    assert "NO  admin_group no-such-group-mvc exists: create it (groupadd no-such-group-mvc)" in out
    assert f"NO  webhook.secret_path {tmp_path}/missing-secret is readable and not empty: cannot read it" in out
    assert f"ok  github_config {tmp_path}/good.yml: the GitHub App settings load and the key {good_key} signs" in out
    assert (f"NO  webhook.github_config {tmp_path}/bad.yml: the GitHub App settings load and the key signs: "
            "the GitHub App private key is not a usable RSA PEM key") in out
