"""The service's classes stay small: one past 25 methods is two roles in one (docs/architecture.md).

The split of the job service (the job API core, workers, admission, the runner desk, the GitHub
reactions, retention) holds only as long as nothing grows back; this reads runner/service's source
and names the class that grew.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "runner" / "service"
MAX_METHODS = 25


def methods_per_class(source: str) -> dict[str, int]:
    """Each class in a module, with how many functions its body defines (properties and dunders included)."""
    tree = ast.parse(source)
    return {node.name: sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_no_class_in_the_service_passes_25_methods() -> None:
    modules = sorted(SERVICE.glob("*.py"))
    assert len(modules) > 10  # the service's own modules were found, not an empty directory
    grown = {f"{path.name}:{name}": count for path in modules
             for name, count in methods_per_class(path.read_text()).items() if count > MAX_METHODS}
    assert grown == {}, f"split these by role: {grown}"


@pytest.mark.parametrize(("methods", "refused"), [(MAX_METHODS, False), (MAX_METHODS + 1, True)])
def test_the_count_sees_a_class_that_grew(methods: int, refused: bool) -> None:
    body = "".join(f"    def m{n}(self) -> None: ...\n" for n in range(methods))
    counted = methods_per_class(f"class Grown:\n{body}")
    assert (counted["Grown"] > MAX_METHODS) is refused
