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
from tests.action.job_records import job_record


def test_refused_artifacts_are_annotated_at_most_ten_times_then_counted(tmp_path: Path) -> None:
    out = io.StringIO()
    inputs = Inputs(run="true", working_directory=".", policy="", artifacts=["**"], timeout_minutes=10,
                    template="base", env_names=[], socket="/nonexistent", include_git=False)
    run = JobDriver(object(), inputs, tmp_path, out, {})
    refused = [(f"out/link{i}", "links are not allowed (link to '/etc/passwd')") for i in range(5000)]
    run._report(Result(record=job_record({"state": "finished", "exit_code": 0}), exit_code=0, junit=None, artifacts=[],
                       refused_artifacts=refused))
    warnings = [line for line in out.getvalue().splitlines() if line.startswith("::warning")]
    assert len(warnings) == 11
    assert warnings[0] == "::warning::artifact out/link0 not copied: links are not allowed (link to '/etc/passwd')"
    assert re.fullmatch(r"::warning::4990 more artifacts not copied \(the result-json output lists them all\)", warnings[-1])


def test_guest_chosen_names_and_errors_reach_annotations_inert(tmp_path: Path) -> None:
    """An artifact's name, its refusal reason and the job's error carry text the guest chose: no mention,
    no control, NUL or bidi character reaches the annotation (GitHub renders annotations, and a mention
    there would notify someone)."""
    out = io.StringIO()
    inputs = Inputs(run="true", working_directory=".", policy="", artifacts=["**"], timeout_minutes=10,
                    template="base", env_names=[], socket="/nonexistent", include_git=False)
    run = JobDriver(object(), inputs, tmp_path, out, {})
    hostile = "@someone\x00\x1b[31m\u202efdp.exe"
    run._report(Result(record=job_record({"state": "failed", "exit_code": 1, "error": f"guest said {hostile}"}), exit_code=1,
                       junit=None, artifacts=[], refused_artifacts=[(f"out/{hostile}", f"refused {hostile}")]))
    lines = [line for line in out.getvalue().splitlines() if line.startswith(("::warning", "::error"))]
    assert len(lines) == 2
    for line in lines:
        assert "@someone" not in line, line
        assert not any(c in line for c in ("\x00", "\x1b", "\u202e")), repr(line)
        assert "someone" in line  # the text is still shown, made inert
