"""`microvm-check policy check|render` through the real CLI hub."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.cli import main

GOOD = "version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n  - cidr: '2001:db8::/32'\n    ports: [443]\n"
BAD = "version: 1\nallow:\n  - host: pypi.org\n    ports: [70000]\n  - cidr: 10.0.0.1/8\n    ports: [443]\n"


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    good, bad = tmp_path / "good.yml", tmp_path / "bad.yml"
    good.write_text(GOOD)
    bad.write_text(BAD)
    return good, bad


def test_check_names_each_valid_file_with_ok(files, capsys):
    good, _ = files
    assert main(["policy", "check", str(good), str(good)]) == 0
    assert capsys.readouterr().out == f"ok {good}\nok {good}\n"


def test_check_prints_every_problem_of_every_file_like_a_linter(files, capsys, tmp_path: Path):
    good, bad = files
    missing = tmp_path / "missing.yml"
    assert main(["policy", "check", str(bad), str(good), str(missing)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{bad}:4:13: ports: 70000 is out of range; use 1..65535",
        f"{bad}:5:11: cidr: '10.0.0.1/8' has host bits set; did you mean 10.0.0.0/8?",
        f"ok {good}",
        f"{missing}: cannot read the policy: No such file or directory",
    ]


def test_render_prints_the_ipv4_or_ipv6_document(files, capsys):
    good, _ = files
    assert main(["policy", "render", str(good)]) == 0
    ipv4 = capsys.readouterr().out
    assert ipv4.startswith("# microvm-check egress policy sha256:") and "*filter" in ipv4
    assert "-A FORWARD -j REJECT --reject-with icmp-admin-prohibited" in ipv4
    assert main(["policy", "render", str(good), "--ipv6"]) == 0
    ipv6 = capsys.readouterr().out
    assert "-A FORWARD -d 2001:db8::/32 -p tcp -m multiport --dports 443 -j ACCEPT" in ipv6


def test_render_of_an_invalid_file_is_a_user_error_not_a_traceback(files, capsys):
    _, bad = files
    assert main(["policy", "render", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"microvm-check: {bad} is not a valid policy:\n{bad}:4:13: ports: 70000")
    assert "Traceback" not in err
