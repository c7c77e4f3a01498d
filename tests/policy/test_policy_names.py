"""Policy model for issue 18: `raw: true` (enforced by address), `on_block`, their composition and
the `policy check` warning; problems name file:line like the rest of the loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy import load_policy
from policy.compose import intersect
from policy.load import PolicyError, raw_warnings
from policy.model import Policy, Rule
from runner.cli import main as cli_main

BASE = "version: 1\nallow:\n  - host: github.com\n    ports: [22]\n    raw: true\n  - host: pypi.org\n    ports: [443]\n"


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as err:
        load_policy(text, "p.yml")
    return [str(problem) for problem in err.value.problems]


def test_raw_and_on_block_load_and_change_the_digest_only_when_set() -> None:
    policy = load_policy(BASE + "on_block: fail\n", "p.yml")
    assert [(r.host, r.raw, r.name_checked) for r in policy.rules] == [("github.com", True, False),
                                                                        ("pypi.org", False, True)]
    assert policy.on_block == "fail"
    plain = load_policy("version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n", "p.yml")
    assert plain.canonical() == {"version": 1, "mode": "block",
                                 "allow": [{"host": "pypi.org", "ports": [443], "protocol": "tcp"}]}
    assert load_policy(BASE, "p.yml").digest() != policy.digest()
    assert Policy(rules=(Rule(frozenset({22}), host="a.org", raw=True),)).digest() != \
        Policy(rules=(Rule(frozenset({22}), host="a.org"),)).digest()


def test_bad_raw_and_on_block_values_are_reported_where_they_are() -> None:
    assert problems("version: 1\non_block: explode\nallow: []\n") == [
        "p.yml:2:11: on_block: 'explode' is not supported; use warn (list refused egress, the default) or fail "
        "(a job whose guest had egress refused fails)"]
    assert problems("version: 1\nallow:\n  - host: a.org\n    ports: [22]\n    raw: yes please\n")[0].startswith(
        "p.yml:5:10: raw: 'yes please' is not true or false")
    assert problems("version: 1\nallow:\n  - cidr: 198.51.100.0/24\n    ports: [22]\n    raw: true\n") == [
        "p.yml:5:10: raw: true applies to a tcp host entry only; cidr: and udp entries are enforced by address "
        "already, so drop it"]


def test_intersection_keeps_the_name_check_and_the_stricter_on_block() -> None:
    repository = load_policy(BASE + "on_block: fail\n", "repo.yml")
    job = load_policy("version: 1\nallow:\n  - host: github.com\n    ports: [22]\n  - host: pypi.org\n    ports: [443]\n",
                      "job.yml")
    both = intersect(repository, job)
    assert both.on_block == "fail"
    assert [(r.host, r.raw) for r in both.rules] == [("github.com", False), ("pypi.org", False)]
    assert intersect(repository, repository).rules[0].raw is True
    assert intersect(job, job).on_block == "warn"


def test_policy_check_warns_that_a_raw_rule_is_enforced_by_address(tmp_path: Path, capsys) -> None:
    path = tmp_path / "job.yml"
    path.write_text(BASE)
    assert cli_main(["policy", "check", "--as", "job", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: warning: github.com ports 22 is raw: enforced by address only" in out
    assert f"ok {path}" in out
    assert raw_warnings(load_policy("version: 1\nallow: []\n", "p.yml")) == []


def test_policy_check_says_a_raw_rule_gives_way_where_a_checked_rule_shares_its_port(tmp_path: Path, capsys) -> None:
    path = tmp_path / "job.yml"
    path.write_text(BASE + "  - host: cdn.test\n    ports: [443, 8443]\n    raw: true\n"
                           "  - host: files.test\n    ports: [8443]\n    paths: [\"/packages/*\"]\n")
    assert cli_main(["policy", "check", "--as", "job", str(path)]) == 0
    out = capsys.readouterr().out
    shares = [line for line in out.splitlines() if " share port(s) " in line]
    assert shares == [
        f"{path}: warning: cdn.test (raw) and files.test (checked by name) share port(s) 8443: where both resolve "
        "to one address, the stricter wins and that address is checked on them, so cdn.test is reached there only "
        "by a name a checked rule allows",
        f"{path}: warning: cdn.test (raw) and pypi.org (checked by name) share port(s) 443: where both resolve "
        "to one address, the stricter wins and that address is checked on them, so cdn.test is reached there only "
        "by a name a checked rule allows"], out  # github.com:22 shares no port: nothing said


def test_the_documented_policy_examples_load_and_mean_what_they_say() -> None:
    root = Path(__file__).resolve().parents[2]
    for doc, after in (("policy/README.md", "## Format"), ("README.md", "## Write a policy")):
        text = (root / doc).read_text().split(after, 1)[1]
        example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
        policy = load_policy(example, doc)
        assert policy.mode == "block", doc
    documented = load_policy((root / "policy/README.md").read_text().split("```yaml\n", 1)[1].split("```", 1)[0])
    assert [rule.host for rule in documented.rules if rule.raw] == ["github.com"]
    assert documented.on_block == "warn"


def test_a_suggestion_turns_refused_requests_into_methods_and_paths() -> None:
    from policy.suggest import REQUEST_REFUSED, AuditRecord, suggest_policy

    records = [AuditRecord("203.0.113.40", 443, "tcp", "pypi.org", 2, REQUEST_REFUSED, "POST", "/legacy/*"),
               AuditRecord("203.0.113.40", 443, "tcp", "pypi.org", 1, REQUEST_REFUSED, "GET", "/upload")]
    wire = [AuditRecord.from_wire(r.to_wire()) for r in records]
    assert wire == records  # method and path prefix survive the job record
    assert AuditRecord.from_wire({**records[0].to_wire(), "path": "/a b/<script>"}).path is None  # type: ignore[union-attr]
    suggested = load_policy(suggest_policy(records), "suggested.yml")
    (rule,) = suggested.rules
    assert (rule.host, rule.methods, rule.paths) == ("pypi.org", frozenset({"GET", "POST"}), ("/legacy/*", "/upload"))
    assert rule.allows_request("POST", "/legacy/x") and not rule.allows_request("DELETE", "/upload")
