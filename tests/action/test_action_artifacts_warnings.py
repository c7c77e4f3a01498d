"""What a guest can make the action and the service say about artifacts it skipped: bounded.

Each skipped member costs the guest about 1.5 KiB of tar (a marker or a link header); each became a
workflow `::warning` line and a service log note of up to ~1.5 KiB, however many there were (the
service's max_count goes up to 10**6). GitHub shows 10 warning annotations per step anyway.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

from action.__main__ import JobDriver
from action.inputs import Inputs
from action.summary import Result


def test_refused_artifacts_are_annotated_at_most_ten_times_then_counted(tmp_path: Path) -> None:
    out = io.StringIO()
    inputs = Inputs(run="true", working_directory=".", policy="", artifacts=["**"], timeout_minutes=10,
                    template="base", env_names=[], socket="/nonexistent", include_git=False)
    run = JobDriver(object(), inputs, tmp_path, out, {})
    refused = [(f"out/link{i}", "links are not allowed (link to '/etc/passwd')") for i in range(5000)]
    run._report(Result(record={"state": "finished", "exit_code": 0}, exit_code=0, junit=None, artifacts=[],
                       refused_artifacts=refused))
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("::warning")]
    assert len(warnings) == 11
    assert warnings[0] == "::warning::artifact out/link0 not copied: links are not allowed (link to '/etc/passwd')"
    assert re.fullmatch(r"::warning::4990 more artifacts not copied \(the result-json output lists them all\)", warnings[-1])
