"""Plumbing for the policy tests.

`tests/policy/` shares its name with the `policy` package, and pytest puts `tests/` on sys.path
(for `tests/conftest.py`) while the editable install resolves `policy` only after the path finder:
without the project root on sys.path, `import policy` finds this directory as a namespace package.
Putting the root first makes the real package win. (The project-wide fix is `pythonpath = ["."]`
under `[tool.pytest.ini_options]`.)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
