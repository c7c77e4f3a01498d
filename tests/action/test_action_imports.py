"""The action runs on the GitHub runner as the runner's user: it must not load the host's network
code (netlink, root-only) or the VM layer just to render a job's summary."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_action_loads_neither_the_network_nor_the_vm_layer():
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import action.__main__, action.summary; "
             "print(' '.join(sorted(m for m in sys.modules if m.startswith(('runner.net', 'runner.vm', 'pyroute2')))))")
    done = subprocess.run([sys.executable, "-I", "-c", probe, str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
