"""The job summary, the step's exit status and outputs, from job records shaped as docs/job-api.md."""

from __future__ import annotations

import json
import re

import pytest

from action.junit import Failure, Totals
from action.summary import Result, cell, exit_code_of, markdown, outputs, repository_path
from microvm_check.entries import Artifact
from tests.action.job_records import job_record

RECORD = {
    "id": "j1", "state": "finished", "repository": "o/r", "sha": "a" * 40, "run_id": 1, "job_name": "t",
    "vm_id": "vm1", "policy_digest": "sha256:abc", "warm": True, "exit_code": 0, "error": None,
    "timings": {"queued_at": 100.0, "vm_ready_at": 100.2, "started_at": 101.0, "finished_at": 111.5,
                "vm_ready_ms": 146.0},
    "blocked_egress": [{"dest": "203.0.113.9", "port": 443, "proto": "tcp",
                        "name": "evil.example|<img src=x onerror=alert(1)>[x](https://evil)", "count": 3}],
    "artifacts": [{"path": "report.xml", "size": 12}],
}


@pytest.mark.parametrize("record,expected", [
    ({"state": "finished", "exit_code": 0}, 0),
    ({"state": "finished", "exit_code": 3}, 3),
    ({"state": "timed_out", "exit_code": 124}, 124),
    ({"state": "timed_out", "exit_code": None}, 124),
    ({"state": "cancelled", "exit_code": 130}, 130),
    ({"state": "failed", "exit_code": None}, 1),
    ({"state": "failed", "exit_code": 0}, 1),  # artifacts rejected after a passing command
    ({"state": "finished", "exit_code": 999}, 1),
    ({"state": "finished", "exit_code": -9}, 1),
    ({"state": "finished", "exit_code": True}, 1),
    ({"state": "finished", "exit_code": "0"}, 1),
])
def test_exit_code(record: dict, expected: int) -> None:
    assert exit_code_of(job_record(record)) == expected


def test_summary_shows_timings_and_escapes_guest_text() -> None:
    failure = Failure("s", "test_<b>x</b>", "c", "failure", "![img](http://evil/x.png)", "", None, None)
    result = Result(job_record(RECORD), 0, Totals(tests=3, failed=1, skipped=1, failures=[failure]),
                    [Artifact("report.xml", 12)], [])
    text = markdown(result)
    assert "| VM ready | 146 ms (warm) |" in text
    assert "| queued | 1.0 s |" in text and "| ran | 10.5 s |" in text
    assert "| tests | 1 passed, 1 failed, 1 skipped |" in text
    assert "<img" not in text and "<b>" not in text and "](" not in text and "https://" not in text
    row = next(line for line in text.splitlines() if "203.0.113.9" in line)
    assert row.count("|") == 7  # the guest's pipe did not add a column


def test_cell_bounds_and_flattens() -> None:
    assert cell("a\nb\r\nc") == "a b c"
    assert len(cell("x" * 1000)) == 200


def test_outputs_carry_the_record_and_totals() -> None:
    result = Result(job_record(RECORD), 0, Totals(tests=2), [Artifact("report.xml", 12)], [("bad", "why")])
    out = outputs(result)
    assert out["exit-code"] == "0" and out["junit-passed"] == "2" and out["junit-failed"] == "0"
    payload = json.loads(out["result-json"])
    assert payload["record"]["id"] == "j1" and payload["refused_artifacts"] == [{"path": "bad", "why": "why"}]


def test_outputs_without_junit_are_empty_strings() -> None:
    out = outputs(Result(job_record(RECORD), 0, None, [], []))
    assert out["junit-passed"] == out["junit-failed"] == ""


@pytest.mark.parametrize("file,expected", [
    ("tests/test_x.py", "sub/tests/test_x.py"),
    ("/workspace/sub/tests/test_x.py", "sub/tests/test_x.py"),
    ("/usr/lib/python3/x.py", None),
    (None, None),
])
def test_report_paths_become_repository_paths(file: str | None, expected: str | None) -> None:
    assert repository_path(file, "sub/") == expected


def test_blocked_egress_comes_with_a_policy_that_would_allow_it() -> None:
    record = {**RECORD, "blocked_egress": [
        {"dest": "203.0.113.9", "port": 443, "proto": "tcp", "name": "pypi.org", "count": 3},
        {"dest": "198.51.100.7", "port": 8080, "proto": "tcp", "name": None, "count": 1},
        {"dest": "203.0.113.9", "port": 53, "proto": "udp", "name": "bad`name|x", "count": 1},  # name dropped
        {"dest": "not-an-ip", "port": 1, "proto": "tcp", "name": None, "count": 1},  # left out
        {"dest": "203.0.113.1", "port": 70000, "proto": "tcp", "name": None, "count": 1},  # left out
    ]}
    text = markdown(Result(job_record(record), 0, None, [], []))
    yaml_text = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    from policy import load_policy

    suggested = load_policy(yaml_text, "suggestion")
    assert suggested.mode == "block"
    assert suggested.allows(443, "tcp", name="pypi.org")
    assert suggested.allows(8080, "tcp", address="198.51.100.7")
    assert suggested.allows(53, "udp", address="203.0.113.9")
    assert not suggested.allows(1, "tcp", address="203.0.113.1")
    assert "`" not in yaml_text and "not-an-ip" not in yaml_text and "70000" not in yaml_text


def test_always_denied_attempts_are_marked_and_left_out_of_the_suggestion() -> None:
    record = {**RECORD, "blocked_egress": [
        {"dest": "169.254.169.254", "port": 80, "proto": "tcp", "name": None, "count": 4, "reason": "always-denied"},
        {"dest": "198.51.100.7", "port": 8080, "proto": "tcp", "name": None, "count": 1, "reason": "policy"},
        {"dest": "198.51.100.8", "port": 8080, "proto": "tcp", "name": None, "count": 1, "reason": "<b>"},
    ]}
    text = markdown(Result(job_record(record), 0, None, [], []))
    yaml_text = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    from policy import load_policy

    suggested = load_policy(yaml_text, "suggestion")
    assert "| 169.254.169.254 | 80 | tcp |  | 4 | always denied (host, metadata or loopback) |" in text
    assert "| 198.51.100.8 | 8080 | tcp |  | 1 | not in the policy |" in text  # an unknown reason is not echoed
    assert not suggested.allows(80, "tcp", address="169.254.169.254")
    assert suggested.allows(8080, "tcp", address="198.51.100.7")
    assert "# always denied, no policy can allow it, was attempted: tcp to 169.254.169.254 port 80" in yaml_text


@pytest.mark.parametrize("name", ["1.2.3.4", "a.123", "*.example.org", "*", "-bad.example", "x" * 64 + ".org",
                                  "ends.with.dot."])
def test_a_name_the_policy_loader_rejects_is_dropped_and_the_suggestion_still_loads(name: str) -> None:
    record = {**RECORD, "blocked_egress": [
        {"dest": "203.0.113.9", "port": 443, "proto": "tcp", "name": name, "count": 1},
        {"dest": "203.0.113.10", "port": 443, "proto": "tcp", "name": "Files.Example.ORG", "count": 1},
    ]}
    text = markdown(Result(job_record(record), 0, None, [], []))
    yaml_text = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    from policy import load_policy

    suggested = load_policy(yaml_text, "suggestion")  # raises if a rejected name made it in
    assert suggested.allows(443, "tcp", address="203.0.113.9")  # by address instead of the bad name
    assert suggested.allows(443, "tcp", name="files.example.org")


def test_digests_render_as_code_on_a_commonmark_renderer() -> None:
    """Before: the policy cell was `sha256&#58;...` inside a code span, where CommonMark decodes no entity."""
    from markdown_it import MarkdownIt

    from action.summary import Result, markdown

    digest = "sha256:" + "ab" * 32
    record = {"id": "j0123abcd", "state": "finished", "exit_code": 0, "policy_digest": digest, "timings": {}}
    html = MarkdownIt("commonmark").enable("table").render(markdown(Result(job_record(record), 0, None, [], [])))
    assert f"<code>{digest}</code>" in html and "<code>j0123abcd</code>" in html
    assert "&amp;#58;" not in html
    hostile = {**record, "id": "x`|<b>y</b>", "policy_digest": "sha256:`evil`"}
    html = MarkdownIt("commonmark").enable("table").render(markdown(Result(job_record(hostile), 0, None, [], [])))
    assert "<b>" not in html and "<code>" not in html.split("<td>job</td>")[1].split("</tr>")[0]


NASTY = "@someone \x00 \x1b[31mred \u202egnp.exe mail me@example.org www.evil.example https://evil.example #1"


def test_guest_text_renders_no_link_mention_or_control_character() -> None:
    """Every place the step summary shows guest text, rendered by cmark-gfm as GitHub renders it."""
    from tests.gfm import acting, render

    record = {**RECORD, "error": NASTY, "blocked_egress": [{"dest": "203.0.113.9", "port": 443, "proto": "tcp",
                                                            "name": NASTY, "count": 1}]}
    failure = Failure("s", NASTY, NASTY, "failure", NASTY, "", None, None)
    text = markdown(Result(job_record(record), 1, Totals(tests=1, failed=1, failures=[failure]),
                           [Artifact(NASTY, 3)], [(NASTY, NASTY)]))
    assert text.count("someone") == 8  # it is there: error, egress name, class and test, message, 3 artifact cells
    assert acting(render(text)) == []


def test_annotations_carry_no_control_character_nor_mention() -> None:
    from action.summary import annotations

    lines = annotations([Failure("s", NASTY, NASTY, "failure", NASTY, "", "tests/test_x.py", 3)])
    assert len(lines) == 1 and "someone" in lines[0]
    assert not re.search(r"[\x00\x1b\u202e]|@[A-Za-z0-9]", lines[0]), lines[0]
