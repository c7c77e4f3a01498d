"""`microvm-check policy check` and a repository's `warm:` section."""

from __future__ import annotations

from pathlib import Path

from runner.cli import main

WARM = """\
version: 1
allow: [{host: pypi.org, ports: [443]}]
warm:
  setup: python3 -m venv /opt/venv && /opt/venv/bin/pip install -r requirements.txt
  inputs: [requirements*.txt, pyproject.toml]
"""
WARM_WITH_EGRESS = WARM + "  policy: {allow: [{host: files.pythonhosted.org, ports: [443]}]}\n"
BAD_WARM = "version: 1\nwarm:\n  setup: pip install .\n  inputs: [../secrets.txt]\n"


def test_a_repository_file_may_have_a_warm_section(tmp_path: Path, capsys) -> None:
    plain, egress = tmp_path / "repo.yml", tmp_path / "microvm-check.yml"
    plain.write_text(WARM)
    egress.write_text(WARM_WITH_EGRESS)
    assert main(["policy", "check", str(plain), str(egress)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"ok {plain} (warm: setup, 2 input pattern(s), setup egress: none)",
        f"ok {egress} (warm: setup, 2 input pattern(s), setup egress: warm.policy within the org default)",
    ]


def test_problems_of_a_warm_section_are_named_like_a_linter(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "repo.yml"
    bad.write_text(BAD_WARM)
    assert main(["policy", "check", str(bad)]) == 1
    assert capsys.readouterr().out == (f"{bad}:4:12: warm.inputs: '../secrets.txt' is not a path inside the checkout; "
                                       "write it relative to the repository's root, without '.', '..' or empty parts\n")


def test_the_org_default_and_a_jobs_policy_may_not_have_one(tmp_path: Path, capsys) -> None:
    store = tmp_path / "policies"
    store.mkdir()
    org, job = store / "_org.yml", tmp_path / "job.yml"
    org.write_text(WARM)
    job.write_text(WARM)
    assert main(["policy", "check", str(org)]) == 1
    assert main(["policy", "check", "--as", "job", str(job)]) == 1
    assert main(["policy", "check", "--as", "repository", str(org)]) == 0
    lines = capsys.readouterr().out.splitlines()
    unknown = "3:1: unknown key 'warm' in the policy; known keys: version, mode, allow, on_block"
    assert lines[:2] == [f"{org}:{unknown}", f"{job}:{unknown}"]
    assert lines[2].startswith(f"ok {org} (warm:")
