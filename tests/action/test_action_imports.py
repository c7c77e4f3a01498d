"""The action runs on the GitHub runner as the runner's user and talks to the service only through the
job API: it must not load the service, the host's network code (netlink, root-only) or the VM layer,
and what it imports of the project is the job API's client and contract plus a few leaf modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The project modules the action may import: the job API, the error base, the safe-tar reader its
# artifacts go through, the JUnit reader it shares with the service, and the policy loader's host check
# and suggestion (no I/O, no privileges).
ALLOWED = ("runner.jobapi", "runner.errors", "runner.tarsafe", "runner.junit", "runner.markdown", "policy.load", "policy.suggest")


def test_the_action_loads_neither_the_service_nor_the_network_nor_the_vm_layer():
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import action.__main__, action.summary; "
             "print(' '.join(sorted(m for m in sys.modules "
             "if m.startswith(('runner.service', 'runner.net', 'runner.vm', 'pyroute2')))))")
    done = subprocess.run([sys.executable, "-I", "-c", probe, str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


def project_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from runner import x` is runner.x
    return {n for n in names if n.split(".")[0] in ("runner", "policy", "vmimages")}


def test_the_action_imports_only_the_job_api_and_leaf_modules_of_the_project():
    found = {name: path.name for path in sorted((ROOT / "action").glob("*.py")) for name in project_imports(path)}
    assert found, "the scan found no project import at all: it no longer reads the action"
    outside = {name: where for name, where in found.items()
               if not any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED)}
    assert outside == {}
