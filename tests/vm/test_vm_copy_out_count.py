"""`Sandbox.copy_out` unpacks a guest's tar with tarsafe's default limits (runner/sandbox/sandbox.py): the
default of 10,000 members is what bounds a guest's file count there. A real guest with 10,001 files
is refused, the first 10,000 kept; no test passed the default before, so raising it went unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.sandbox import SandboxError

MAKE_FILES = "import os\nos.makedirs('/workspace/many')\nfor n in range(10_001):\n    open(f'/workspace/many/{n}', 'w').close()\n"


def test_copy_out_refuses_a_guests_ten_thousand_and_first_file(sandbox, tmp_path: Path) -> None:
    made = sandbox.exec(["python3", "-c", MAKE_FILES], timeout_seconds=300)
    assert made.exit_code == 0, made.stderr
    with pytest.raises(SandboxError, match="^refused the guest's files from /workspace/many: more than 10000 entries"):
        sandbox.copy_out("/workspace/many", tmp_path)
    assert len(list((tmp_path / "many").iterdir())) == 10_000
