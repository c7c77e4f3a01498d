"""The tests' tree mirrors the packages' (issue 41): a newcomer finds the tests of `runner/service/jobs/egress.py`
in `tests/service/jobs/test_egress*.py`, of `runner/httpserve.py` in `tests/test_httpserve*.py`, of
`vmimages/oci/` in `tests/vmimages/oci/`; and what needs real VMs is marked `vm` and kept apart by its name
(`test_vm_*.py`, `test_action_vm_*.py`) or its folder (`tests/e2e/`, whole paths through a real service)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# Folders that mirror no package, and why.
APART = {
    "e2e": "whole paths (the CLI, `serve`, the SDK, the page) through real VMs: each crosses every package",
    "fuzz": "properties of the hostile inputs' parsers across packages, under one hypothesis budget",
}
# Top-level test files about the project as a whole, not one module, and what each is about.
PROJECT = {
    "test_bench_smoke.py": "bench/",
    "test_citations.py": "the docs",
    "test_hypothesis_profile.py": "the suite's own profile",
    "test_layers.py": "pyproject.toml's import contracts",
    "test_locks.py": "requirements/",
    "test_public_api.py": "every package's __all__",
    "test_reference.py": "tests/reference.py",
    "test_tree.py": "this tree",
    "test_user_errors.py": "every command's errors",
}
VM_NAMES = re.compile(r"test_(action_)?vm_")
VM_MARK = re.compile(r"^(pytestmark = .*|\s*@)pytest\.mark\.vm\b", re.M)


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _package_of(folder: Path) -> list[Path]:
    """Where the package a test folder mirrors may be: `tests/X` is `runner/X` or the top-level `X`."""
    rel = folder.relative_to(TESTS)
    return [ROOT / "runner" / rel, ROOT / rel]


def test_every_test_folder_mirrors_a_package_or_says_why_it_is_apart() -> None:
    strays = []
    for folder in sorted({p.parent for p in _test_files()} - {TESTS}):
        top = folder.relative_to(TESTS).parts[0]
        if top in APART:
            continue
        if not any(place.is_dir() for place in _package_of(folder)):
            strays.append(folder.relative_to(ROOT).as_posix())
    assert not strays, f"test folders that mirror no package (runner/X or X): {strays}; move their tests or add to APART"


def test_every_top_level_test_file_names_a_module_of_runner_or_the_project() -> None:
    modules = {p.stem for p in (ROOT / "runner").glob("*.py")}
    strays = [p.name for p in TESTS.glob("test_*.py")
              if p.name not in PROJECT and not any(re.match(rf"test_{m}(_|\.py$)", p.name) for m in modules)]
    assert not strays, f"top-level test files that name no runner/*.py module: {strays}"


def test_real_vm_tests_are_marked_and_kept_apart_by_name_or_folder() -> None:
    """A file that marks its tests `vm` is named so or lies in tests/e2e, and one in tests/e2e is marked."""
    misplaced, unmarked = [], []
    for path in _test_files():
        marked = VM_MARK.search(path.read_text()) is not None
        in_e2e = path.relative_to(TESTS).parts[0] == "e2e"
        if marked and not (in_e2e or VM_NAMES.match(path.name)):
            misplaced.append(path.relative_to(ROOT).as_posix())
        if in_e2e and not marked:
            unmarked.append(path.relative_to(ROOT).as_posix())
    assert not misplaced, f"files of real-VM tests named like the others: {misplaced} (name them test_vm_*.py)"
    assert not unmarked, f"tests/e2e files whose tests are not marked vm: {unmarked}"
