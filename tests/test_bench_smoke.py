"""Every benchmark runs once, in its smoke mode, so a benchmark that no longer runs fails the suite.

Discovery: every bench/*.py with an `if __name__ == "__main__":` block is a benchmark (bench/stats.py,
a helper, has none); a new one is covered as soon as it exists. It runs as
`python bench/NAME.py --smoke` unless it declares its own smoke arguments as a module-level list of
string literals, `SMOKE_ARGS = ["--runs", "2"]` (read here with ast, never imported). A benchmark that
reads payloads no package has (tests/reference.py CAPTURED) names them the same way, `NEEDS_CAPTURED =
[...]`: without them its smoke run says so and skips (fails under CI=true), as the tests that need them do.
A smoke run takes a few samples and judges no goal: it must exit 0 and end with the benchmark's one-line
JSON object of numbers (see bench/README.md). Nothing here is timed.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import reference
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TIMEOUT_S = 1200  # a whole smoke run under TCG on a busy 2-core machine stays far below this


def _is_main_guard(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _declared(path: Path, name: str) -> list[str] | None:
    """A benchmark's module-level list of string literals `name`, read with ast; None if it has none."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == name):
            value = ast.literal_eval(node.value)
            assert isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value), (
                f"{path.name}: {name} must be a list of string literals, not {value!r}")
            return list(value)
    return None


def smoke_args(path: Path) -> list[str] | None:
    """The smoke command-line arguments of a benchmark, or None if `path` is not one (a helper)."""
    tree = ast.parse(path.read_text(), str(path))
    if not any(_is_main_guard(node) for node in tree.body):
        return None
    declared = _declared(path, "SMOKE_ARGS")
    return declared if declared is not None else ["--smoke"]


BENCHMARKS = sorted(p for p in BENCH.glob("*.py") if smoke_args(p) is not None)


def test_every_benchmark_is_discovered() -> None:
    names = {p.name for p in BENCHMARKS}
    assert {"restore.py", "job.py", "net.py", "warm.py", "fleet.py", "docker.py", "api_load.py"} <= names, names
    assert "stats.py" not in names  # a helper


def test_smoke_args_are_read_from_the_declaration(tmp_path: Path) -> None:
    (tmp_path / "helper.py").write_text("def f():\n    return 1\n")
    (tmp_path / "default.py").write_text("if __name__ == '__main__':\n    pass\n")
    (tmp_path / "declared.py").write_text("SMOKE_ARGS = ['--runs', '2']\nif __name__ == '__main__':\n    pass\n")
    (tmp_path / "bad.py").write_text("SMOKE_ARGS = ['--runs', 2]\nif __name__ == '__main__':\n    pass\n")
    (tmp_path / "needs.py").write_text("NEEDS_CAPTURED = ['x.json']\nif __name__ == '__main__':\n    pass\n")
    assert _declared(tmp_path / "needs.py", "NEEDS_CAPTURED") == ["x.json"]
    assert _declared(tmp_path / "declared.py", "NEEDS_CAPTURED") is None
    assert smoke_args(tmp_path / "helper.py") is None
    assert smoke_args(tmp_path / "default.py") == ["--smoke"]
    assert smoke_args(tmp_path / "declared.py") == ["--runs", "2"]
    with pytest.raises(AssertionError, match="list of string literals"):
        smoke_args(tmp_path / "bad.py")


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_runs_in_smoke_mode(bench: Path, need_netns: None) -> None:
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    args = smoke_args(bench)
    assert args is not None
    for name in _declared(bench, "NEEDS_CAPTURED") or []:
        reference.captured_path(name)  # missing: says what and where from, and skips (fails under CI=true)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        done = subprocess.run([sys.executable, str(bench), *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{bench.name} {' '.join(args)} ran past {TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    output = f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"{bench.name} {' '.join(args)} exited {done.returncode}\n{output}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{bench.name} printed nothing\n{output}"
    result = json.loads(lines[-1])
    assert isinstance(result, dict) and result, f"{bench.name}: the last line is not a JSON object\n{output}"
    bad = {k: v for k, v in result.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    assert not bad, f"{bench.name}: non-numeric results {bad}\n{output}"
