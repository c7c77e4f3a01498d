"""The job summary names an internal address the resolver refused for an allowed name as such."""

from __future__ import annotations

from action.summary import Result, markdown
from runner.net.audit import refused_answer_record

RECORD = {"id": "j1", "state": "finished", "repository": "o/r", "sha": "a" * 40, "exit_code": 0, "error": None,
          "blocked_egress": [refused_answer_record("10.0.0.5", "lan.test", 2).as_json(),
                             {"dest": "198.51.100.7", "port": 8080, "proto": "tcp", "name": None, "count": 1,
                              "reason": "policy"}]}


def test_a_refused_internal_answer_is_explained_and_not_suggested() -> None:
    text = markdown(Result(RECORD, 0, None, [], []))

    row = next(line for line in text.splitlines() if "10.0.0.5" in line and line.startswith("|"))
    assert "internal address" in row and "not in the policy" not in row
    yaml_text = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert "lan.test" not in yaml_text and "198.51.100.7/32" in yaml_text  # allowing it is the user's decision


def test_records_without_a_port_show_a_dash_not_none() -> None:
    icmp = {"dest": "198.51.100.9", "port": None, "proto": "icmp", "name": None, "count": 3, "reason": "policy"}
    text = markdown(Result({**RECORD, "blocked_egress": [*RECORD["blocked_egress"], icmp]}, 0, None, [], []))

    rows = [line for line in text.splitlines() if line.startswith("| 10.0.0.5 ") or line.startswith("| 198.51.100.9 ")]
    assert len(rows) == 2 and all(row.split("|")[2].strip() == "-" for row in rows)
    assert "None" not in text
