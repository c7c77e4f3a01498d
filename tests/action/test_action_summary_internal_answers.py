"""The job summary on internal addresses: a refused DNS answer is named without its address (the summary
is public), a dialled internal address is explained, and neither is ever suggested as a rule."""

from __future__ import annotations

from action.summary import Result, markdown, outputs
from policy import load_policy
from policy.suggest import REFUSED_DEST
from runner.net.audit import refused_answer_record
from tests.action.job_records import job_record

LAN_ADDRESS = "10.0.0.5"
RECORD = {"id": "j1", "state": "finished", "repository": "o/r", "sha": "a" * 40, "exit_code": 0, "error": None,
          "blocked_egress": [refused_answer_record("lan.test", 2).to_wire(),
                             {"dest": "198.51.100.7", "port": 8080, "proto": "tcp", "name": None, "count": 1,
                              "reason": "policy"}]}


def suggestion(text: str) -> str:
    return text.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_a_refused_internal_answer_is_explained_and_not_suggested() -> None:
    text = markdown(Result(job_record(RECORD), 0, None, [], []))

    row = next(line for line in text.splitlines() if "lan.test" in line and line.startswith("|"))
    assert row.startswith(f"| {REFUSED_DEST} | - | dns | lan.test | 2 |")
    assert "internal address" in row and "not in the policy" not in row
    assert "lan.test" not in suggestion(text) and "198.51.100.7/32" in suggestion(text)  # allowing it is a decision


def test_the_public_summary_and_outputs_never_show_a_refused_address() -> None:
    """Attack: with a split-horizon host resolver, a fork CNAMEs an allowed name to an internal name and
    reads its private address from the public job summary. A record that still carries the address
    (from a service before this change) is shown without it too."""
    legacy = {"dest": LAN_ADDRESS, "port": None, "proto": "dns", "name": "intranet.web.test", "count": 1,
              "reason": "internal-address"}
    for blocked in (RECORD["blocked_egress"], [legacy]):
        record = {**RECORD, "blocked_egress": blocked}
        text = markdown(Result(job_record(record), 0, None, [], []))
        assert LAN_ADDRESS not in text and REFUSED_DEST in text
    assert LAN_ADDRESS not in outputs(Result(job_record(RECORD), 0, None, [], []))["result-json"]


def test_a_dialled_internal_address_is_explained_and_only_named_in_the_suggestion() -> None:
    """The guest knows an address it dialled, so it is shown; allowing it is not suggested (not even
    by the name the resolver would have handed out for it)."""
    dialled = {"dest": LAN_ADDRESS, "port": 8000, "proto": "tcp", "name": "lan.test", "count": 3,
               "reason": "internal-address"}
    text = markdown(Result(job_record({**RECORD, "blocked_egress": [dialled, *RECORD["blocked_egress"][1:]]}), 0, None, [], []))

    assert f"| {LAN_ADDRESS} | 8000 | tcp | lan.test | 3 | an internal address, refused in every mode" in text
    suggested = load_policy(suggestion(text), "suggestion")
    assert not suggested.allows(8000, "tcp", address=LAN_ADDRESS)
    assert not suggested.allows(8000, "tcp", name="lan.test")
    assert f"an internal address, refused in every mode, was attempted: tcp to {LAN_ADDRESS} port 8000" in text


def test_records_without_a_port_show_a_dash_not_none() -> None:
    icmp = {"dest": "198.51.100.9", "port": None, "proto": "icmp", "name": None, "count": 3, "reason": "policy"}
    text = markdown(Result(job_record({**RECORD, "blocked_egress": [*RECORD["blocked_egress"], icmp]}), 0, None, [], []))

    rows = [line for line in text.splitlines() if line.startswith(f"| {REFUSED_DEST} ") or line.startswith("| 198.51.100.9 ")]
    assert len(rows) == 2 and all(row.split("|")[2].strip() == "-" for row in rows)
    assert "None" not in text
