"""What the walls hide from the runners (runner/fleet/walls.py gives each an empty tmpfs of its own on /tmp,
/var/tmp, /dev/shm and /run/lock) must not be what they run: `serve` refuses to start a fleet whose release,
runner directories or installation lie there, saying where to put them; `doctor` says the same; and
scripts/test stops at once, before its setup, when the checkout lies there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from runner.fleet import walls
from runner.service.config.reading import ConfigError, load_config
from tests.fleet.conftest import ROOT, Account, write_config


def _serve(path: Path) -> None:
    from runner.service.host.assembly import ServiceHost

    with ServiceHost(load_config(path), sandboxes=_no_vms, origin=str(path)):
        pass


@pytest.mark.parametrize("key", ["install_dir", "runners_dir"])
def test_serve_refuses_a_fleet_whose_directories_lie_under_tmp(account: Account, rig_root: Path, key: str) -> None:
    path = write_config(rig_root, account, {key: f"/tmp/mvc-hidden/{key}"})
    with pytest.raises(ConfigError, match=rf"runners: runners\.{key} /tmp/mvc-hidden/{key} lies under /tmp, which "
                                          r"every runner sees as an empty tmpfs of its own .*Put them where the host's "
                                          r"own files are: clone microvm-check to /opt/microvm-check"):
        _serve(path)
    assert not (rig_root / "runners").exists(), "the fleet started before it refused"


def test_serve_refuses_an_installation_whose_directory_links_under_var_tmp(account: Account, rig_root: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    checkout = Path(tempfile.mkdtemp(prefix="mvc-hidden-checkout-", dir="/var/tmp"))
    try:
        (checkout / ".venv" / "bin").mkdir(parents=True)
        (checkout / ".venv" / "bin" / "python").symlink_to(sys.executable)  # a venv's python: a link out of it
        (rig_root / "checkout").symlink_to(checkout)  # as /opt/microvm-check -> /var/tmp/...
        path = write_config(rig_root, account, {})
        monkeypatch.setattr(sys, "executable", str(rig_root / "checkout" / ".venv" / "bin" / "python"))
        with pytest.raises(ConfigError, match=rf"this installation's Python \(the runners' hooks run it\) \S+/checkout/"
                                              rf"\.venv/bin/python \({checkout}/\.venv/bin/python\) lies under /var/tmp"):
            _serve(path)
    finally:
        shutil.rmtree(checkout)


def test_serve_refuses_a_fleet_when_this_installation_lies_under_tmp(account: Account, rig_root: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(rig_root, account, {})
    monkeypatch.setattr(sys, "executable", "/tmp/microvm-check/.venv/bin/python")  # a checkout cloned into /tmp
    with pytest.raises(ConfigError, match=r"this installation's Python \(the runners' hooks run it\) "
                                          r"/tmp/microvm-check/\.venv/bin/python lies under /tmp"):
        _serve(path)


def test_doctor_says_which_runner_paths_the_walls_hide(account: Account, rig_root: Path, capsys) -> None:
    from runner.cli import main

    main(["doctor", "--config", str(write_config(rig_root, account, {"install_dir": "/dev/shm/release"}))])
    hidden = capsys.readouterr().out
    main(["doctor", "--config", str(write_config(rig_root, account, {}))])
    seen = capsys.readouterr().out
    assert "NO  the runners see what they run: this installation, install_dir, runners_dir and the socket lie " \
           "outside /tmp, /var/tmp, /dev/shm, /run/lock and below directories every user may enter: " \
           "runners.install_dir /dev/shm/release lies under /dev/shm" \
           in hidden, hidden
    assert "install_dir /opt/microvm-check/actions-runner" in hidden
    assert "ok  the runners see what they run" in seen, seen


@pytest.mark.parametrize("place", [where for where, _ in walls.PRIVATE_TMPFS])
def test_scripts_test_stops_at_once_in_a_checkout_the_runners_cannot_see(place: str) -> None:
    checkout = Path(tempfile.mkdtemp(prefix="mvc-checkout-", dir=place))
    try:
        (checkout / "scripts").mkdir()
        shutil.copy2(ROOT / "scripts" / "test", checkout / "scripts" / "test")
        done = subprocess.run(["bash", str(checkout / "scripts" / "test")], capture_output=True, text=True, cwd="/",
                              timeout=60)
    finally:
        shutil.rmtree(checkout)
    assert done.returncode == 1, done
    assert f"this checkout ({checkout}) lies under {place}, which every fleet runner sees" in done.stderr, done.stderr
    assert "Clone it elsewhere" in done.stderr


def test_serve_refuses_a_fleet_whose_runners_dir_lies_under_a_directory_others_may_not_enter(
        account: Account, rig_root: Path) -> None:
    closed = rig_root / "closed"
    closed.mkdir(mode=0o700)  # as Debian's /root
    path = write_config(rig_root, account, {"runners_dir": str(closed / "runners")})
    with pytest.raises(ConfigError, match=rf"runners\.runners_dir {closed}/runners lies under {closed}, which other "
                                          r"users may not enter \(mode 700; every runner has a uid of its own\)"):
        _serve(path)
    assert not (closed / "runners").exists(), "the fleet started before it refused"


def test_scripts_test_stops_at_once_in_a_checkout_under_a_directory_others_may_not_enter(rig_root: Path) -> None:
    closed = rig_root / "home"
    closed.mkdir(mode=0o700)  # as Debian's /root, where root's `git clone` lands by default
    checkout = closed / "microvm-check"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy2(ROOT / "scripts" / "test", checkout / "scripts" / "test")
    done = subprocess.run(["bash", str(checkout / "scripts" / "test")], capture_output=True, text=True, cwd="/",
                          timeout=60)
    assert done.returncode == 1, done
    assert f"this checkout ({checkout}) lies under {closed}, which other users may not enter (mode 700)" \
        in done.stderr, done.stderr


def _no_vms(request: Any) -> Any:
    raise AssertionError("the fleet refuses before anything runs: no VM may be created")
