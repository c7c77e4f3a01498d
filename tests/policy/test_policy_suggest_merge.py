"""`microvm-check policy suggest`: the audit records of many jobs of one repository, read from the
service's SQLite records, merged into one block-mode policy with how often and when each rule was needed."""

from __future__ import annotations

import calendar
import time
from pathlib import Path

import pytest

from policy import load_policy
from policy.suggest import (
    ALWAYS_DENIED,
    INTERNAL_ADDRESS,
    REFUSED_NAME,
    AuditRecord,
    JobAudit,
    admitted,
    merged_policy,
)
from runner.cli import main
from runner.jobapi.contract import JobRecord, JobState
from runner.service.jobs.records import RecordStore

T0 = calendar.timegm((2024, 5, 1, 12, 0, 0))  # 2024-05-01 12:00 UTC
DAY = 86400
WEB = {"dest": "203.0.113.10", "port": 8000, "proto": "tcp", "name": "web.test", "count": 2, "reason": "policy"}
WEB_9000 = {**WEB, "port": 9000, "count": 1}
MIRROR = {"dest": "198.51.100.7", "port": 53, "proto": "udp", "name": None, "count": 3, "reason": "policy"}
METADATA = {"dest": "169.254.169.254", "port": 80, "proto": "tcp", "name": None, "count": 1, "reason": "always-denied"}


def record_from_json(entry: object) -> AuditRecord | None:
    """A job record's entry as a suggestion reads it: from the wire, named only by a name a policy loads."""
    record = AuditRecord.from_wire(entry)
    return None if record is None else admitted(record)


def test_three_jobs_with_different_needs_make_one_policy_allowing_all_of_them() -> None:
    jobs = [JobAudit("j1", T0, (AuditRecord("203.0.113.10", 8000, "tcp", "web.test", 2),)),
            JobAudit("j2", T0 + 3600, (AuditRecord("203.0.113.10", 9000, "tcp", "web.test", 1),
                                       AuditRecord("169.254.169.254", 80, "tcp", None, 1, ALWAYS_DENIED))),
            JobAudit("j3", T0 + DAY, (AuditRecord("198.51.100.7", 53, "udp", None, 3),
                                      AuditRecord("169.254.169.254", 80, "tcp", None, 2, ALWAYS_DENIED)))]

    text = merged_policy(jobs, "from 3 jobs of octo/app")

    assert text == (
        "# from 3 jobs of octo/app\n"
        "version: 1\n"
        "mode: block\n"
        "allow:\n"
        "  # seen in 1 of 3 jobs, 3 attempts, first 2024-05-02 12:00 UTC, last 2024-05-02 12:00 UTC\n"
        "  - cidr: 198.51.100.7/32\n"
        "    ports: [53]\n"
        "    protocol: udp\n"
        "  # seen in 2 of 3 jobs, 3 attempts, first 2024-05-01 12:00 UTC, last 2024-05-01 13:00 UTC\n"
        "  - host: web.test\n"
        "    ports: [8000, 9000]\n"
        "# always denied, no policy can allow it, was attempted: tcp to 169.254.169.254 port 80 "
        "(seen in 2 of 3 jobs, 3 attempts, first 2024-05-01 13:00 UTC, last 2024-05-02 12:00 UTC)\n")
    policy = load_policy(text, "merged.yml")
    assert policy.mode == "block"
    assert policy.allows(8000, "tcp", name="web.test") and policy.allows(9000, "tcp", name="web.test")
    assert policy.allows(53, "udp", address="198.51.100.7")
    assert not policy.allows(80, "tcp", address="169.254.169.254")


def test_what_no_policy_should_allow_is_only_ever_a_comment() -> None:
    jobs = [JobAudit("j1", T0, (AuditRecord("10.0.0.5", 8000, "tcp", None, 1, INTERNAL_ADDRESS),
                                AuditRecord("name refused", None, "dns", "denied.test", 4, REFUSED_NAME),
                                AuditRecord("203.0.113.20", None, "icmp", None, 1)))]

    text = merged_policy(jobs)

    assert load_policy(text, "merged.yml").rules == ()
    assert text.startswith("version: 1\nmode: block\nallow: []\n")
    assert "# denied.test was looked up and refused (no rule names it), so no port was tried" in text
    assert "# an internal address, refused in every mode, was attempted: tcp to 10.0.0.5 port 8000" in text


@pytest.mark.parametrize("entry", [
    {**WEB, "dest": "not-an-ip"}, {**WEB, "port": 70000}, {**WEB, "port": True}, {**WEB, "proto": "sctp"},
    {"dest": "name refused", "port": None, "proto": "dns", "name": "a\n- host: evil.example", "reason": REFUSED_NAME},
    {"dest": "name refused", "port": None, "proto": "dns", "name": "x.example", "reason": "policy"}, "text", None,
])
def test_a_malformed_record_entry_is_dropped(entry: object) -> None:
    assert record_from_json(entry) is None


def test_a_bad_name_or_count_is_dropped_from_an_entry_that_is_otherwise_good() -> None:
    record = record_from_json({**WEB, "name": "a\n- host: evil.example", "count": -5, "reason": "<b>"})
    assert record == AuditRecord("203.0.113.10", 8000, "tcp", None, 1, "policy")


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A service state directory with the job records of two repositories, one job older than 14 days."""
    now = time.time()
    store = RecordStore(tmp_path / "jobs.sqlite")
    jobs = [("j0000000000000001", "octo/app", now - 20 * DAY, [{**WEB, "port": 7000}]),
            ("j0000000000000002", "octo/app", now - 2 * DAY, [WEB, METADATA]),
            ("j0000000000000003", "octo/app", now - DAY, [WEB_9000, {"garbage": 1}]),
            ("j0000000000000004", "octo/app", now - 3600, []),
            ("j0000000000000005", "octo/other", now - 60, [MIRROR])]
    for job_id, repository, created, blocked in jobs:
        store.put(JobRecord(id=job_id, state=JobState.FINISHED, repository=repository, sha="a" * 40, run_id=None,
                            run_attempt=None, job_name="test", created_at=created,
                            blocked_egress=[r for r in map(AuditRecord.from_wire, blocked) if r]))
    store.close()
    return tmp_path


def test_suggest_reads_the_repositorys_jobs_of_the_last_14_days(state_dir: Path, capsys) -> None:
    assert main(["policy", "suggest", "--repository", "octo/app", "--state-dir", str(state_dir)]) == 0
    text = capsys.readouterr().out

    lines = text.splitlines()
    assert lines[0].startswith("# Suggested by `microvm-check policy suggest` from 3 jobs of octo/app since ")
    assert lines[0].endswith(" UTC, 2 of which tried egress their policy did not allow.")
    assert lines[1] == "# Review it before adopting it: it allows what these jobs tried, nothing more."
    policy = load_policy(text, "suggested.yml")
    assert [(rule.host, sorted(rule.ports)) for rule in policy.rules] == [("web.test", [8000, 9000])]
    assert "  # seen in 2 of 3 jobs, 3 attempts, first " in text
    assert "always denied, no policy can allow it, was attempted: tcp to 169.254.169.254 port 80" in text
    assert "7000" not in text and "198.51.100.7" not in text  # too old, another repository

    assert main(["policy", "suggest", "--repository", "octo/app", "--since", "30d", "--state-dir", str(state_dir)]) == 0
    assert "ports: [7000, 8000, 9000]" in capsys.readouterr().out


def test_suggest_reads_the_records_of_a_service_config(state_dir: Path, tmp_path: Path, capsys) -> None:
    config = tmp_path / "service.yml"
    config.write_text(f"state_dir: {state_dir}\n")
    assert main(["policy", "suggest", "--repository", "octo/other", "--config", str(config)]) == 0
    assert "  - cidr: 198.51.100.7/32\n    ports: [53]\n    protocol: udp\n" in capsys.readouterr().out


def test_suggest_says_what_is_missing(state_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["policy", "suggest", "--repository", "octo/nothing", "--state-dir", str(state_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("microvm-check: no jobs of octo/nothing since ")
    assert err.endswith(" UTC in the job records: nothing to suggest from (names are OWNER/NAME as "
                        "`microvm-check jobs` shows them)\n")

    empty = tmp_path / "empty"
    assert main(["policy", "suggest", "--repository", "octo/app", "--state-dir", str(empty)]) == 1
    assert capsys.readouterr().err == (f"microvm-check: no job records at {empty}/jobs.sqlite: pass the service's "
                                       "--state-dir or --config\n")
    assert not empty.exists()  # reading never creates a records file

    with pytest.raises(SystemExit):
        main(["policy", "suggest", "--repository", "octo/app", "--since", "3x"])
    assert capsys.readouterr().err.endswith(
        "microvm-check policy suggest: error: argument --since: expected an age like 14d, 12h, 30m or 2w, not '3x'\n")


def test_suggest_says_when_jobs_had_no_network_card_to_see_anything_through(tmp_path: Path, capsys) -> None:
    """Before: "0 tried egress" over deny-all jobs, as if they had tried nothing; their VMs had no NIC at all."""
    from policy import DENY_ALL

    store = RecordStore(tmp_path / "jobs.sqlite")
    for i in range(2):
        store.put(JobRecord(id=f"j000000000000000{i}", state=JobState.FINISHED, repository="octo/quiet", sha="a" * 40,
                            run_id=None, run_attempt=None, job_name="test", created_at=time.time() - 60,
                            policy_digest=DENY_ALL.digest()))
    store.close()
    assert main(["policy", "suggest", "--repository", "octo/quiet", "--state-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "from 2 jobs of octo/quiet since " in text and "0 of which tried egress" in text
    assert ("# 2 of them had no network card (their policy allowed nothing, in block mode), so nothing they tried "
            "could be seen: run the repository with `mode: audit` to learn what it needs.") in text


def test_refused_requests_across_jobs_become_methods_and_paths_entries() -> None:
    from policy.suggest import REQUEST_REFUSED

    jobs = [JobAudit("j1", T0, (AuditRecord("203.0.113.40", 443, "tcp", "pypi.org", 2, REQUEST_REFUSED, "POST", "/legacy/*"),)),
            JobAudit("j2", T0 + DAY, (AuditRecord("203.0.113.40", 443, "tcp", "pypi.org", 1, REQUEST_REFUSED, "GET", "/upload"),
                                      AuditRecord("203.0.113.10", 8000, "tcp", "web.test", 1)))]

    text = merged_policy(jobs)

    policy = load_policy(text, "merged.yml")
    assert sorted((r.host, sorted(r.ports), sorted(r.methods), r.paths) for r in policy.rules) == [
        ("pypi.org", [443], ["GET", "POST"], ("/legacy/*", "/upload")),
        ("web.test", [8000], [], ())]
    assert "  # seen in 2 of 2 jobs, 3 attempts, first 2024-05-01 12:00 UTC, last 2024-05-02 12:00 UTC\n" \
           "  - host: pypi.org\n" in text
    assert "was refused by the rule's methods/paths" not in text  # an entry now, not a comment


def test_connections_that_named_nothing_become_a_raw_entry_with_its_warning() -> None:
    record = AuditRecord("203.0.113.10", 22, "tcp", "git.test", 3, unnamed=True)
    assert record_from_json(record.to_wire()) == record  # the flag survives the job record
    assert record_from_json({**record.to_wire(), "unnamed": "yes"}).unnamed is False  # type: ignore[union-attr]

    text = merged_policy([JobAudit("j1", T0, (record, AuditRecord("203.0.113.10", 443, "tcp", "git.test", 1)))])

    policy = load_policy(text, "merged.yml")
    assert sorted((r.host, sorted(r.ports), r.raw) for r in policy.rules) == [
        ("git.test", [22], True), ("git.test", [443], False)]
    assert "  # warning: git.test ports 22: the job's connections there named nothing the host can check" in text
