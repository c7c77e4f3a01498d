"""The import-linter contracts in pyproject.toml hold on the real tree and catch a planted violation.

scripts/test runs `lint-imports` before pytest; these tests show that the check it runs is not
vacuous: a copy of the tree with one forbidden import (a cycle between the VM layer and the service
that is built on it) fails it, naming the contract and the import.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("runner", "policy", "vmimages", "action")


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over `tree` with the project's own contracts, importing nothing from elsewhere."""
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", str(tree / "pyproject.toml")],
                          cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=300)


def copy_tree(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_real_tree_keeps_every_contract() -> None:
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_planted_cycle_between_vm_and_service_fails_the_check(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path)
    planted = tree / "runner" / "vm" / "planted.py"
    planted.write_text('"""A VM module that reaches up into the service."""\n'
                       "from runner.service.config.settings import ServiceConfig\n")
    done = lint_imports(tree)
    assert done.returncode != 0
    assert "Layers: commands -> service" in done.stdout
    assert "runner.vm is not allowed to import runner.service" in done.stdout
    assert "runner.vm.planted -> runner.service.config.settings" in done.stdout


def test_the_action_may_not_import_the_service(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path)
    (tree / "action" / "planted.py").write_text("from runner.service import records\n")
    done = lint_imports(tree)
    assert done.returncode != 0
    assert "action is not allowed to import runner.service" in done.stdout
