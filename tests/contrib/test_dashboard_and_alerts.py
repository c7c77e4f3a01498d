"""contrib/: the Grafana dashboard and the Prometheus alert rules use only metrics (and labels) the service
exports, and the rules pass `promtool check rules` and their own `promtool test rules` unit tests."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from microvm_check.entries import AuditRecord
from runner.jobapi.contract import JobRecord, JobState, Timings
from runner.service.api.metrics import JobMetrics, ServiceView
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "contrib" / "grafana" / "microvm-check.json"
RULES = ROOT / "contrib" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "alerts.test.yml"
# Added by Prometheus at scrape time (instance, job) or part of a histogram's series (le).
SCRAPE_LABELS = {"instance", "job", "le"}
_NAME = re.compile(r"\b(microvm_check_[a-z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_BY = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def exported() -> dict[str, set[str]]:
    """Every series name the service's registry exports, with its label names: the collector with all its
    sources (engine, fleet, webhook) and one observation of each per-event metric."""
    metrics = JobMetrics()
    metrics.watch(ServiceView(
        active_jobs=lambda: [], queued=lambda: 0, prewarmed=lambda: 0, prewarm_max=2, live_vms=lambda: 1,
        spare_vms=lambda: 1, spare_pool_size=1, runners=lambda: [SimpleNamespace(state="idle")],
        protocol_errors=lambda: {"frame": 0}, webhook_deliveries=lambda: {("workflow_job", "ok"): 1}))
    now = time.time()
    record = JobRecord("j1", JobState.FINISHED, "o/r", "a" * 40, 1, 1, "check", exit_code=0,
                       timings=Timings(now - 9, now - 8, now - 7, now, 30.0),
                       blocked_egress=[AuditRecord("203.0.113.9", 443, "tcp", None, 1, "policy")])
    metrics.saw(record)
    metrics.request("tcp", "/v1/jobs", "GET", 200, 0.01)
    metrics.runner_started()
    metrics.runner_ended(False)
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    found = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    found += [(f"variable {v['name']}", v["definition"]) for v in dashboard["templating"]["list"] if "definition" in v]
    rules = yaml.safe_load(RULES.read_text())
    found += [(f"alert {r['alert']}", r["expr"]) for g in rules["groups"] for r in g["rules"]]
    return found


def test_queries_use_only_exported_metrics_and_labels() -> None:
    have = exported()
    assert "microvm_check_jobs_total" in have and "microvm_check_vm_ready_seconds_bucket" in have
    seen = set()
    for where, expr in expressions():
        names = _NAME.findall(expr)
        assert names, f"{where}: no microvm-check metric in {expr!r}"
        labels_of_expr = set(SCRAPE_LABELS)
        for name, selector in names:
            assert name in have, f"{where}: {name} is not exported by the service"
            seen.add(name)
            labels_of_expr |= have[name]
            for label in _MATCHER.findall(selector):
                assert label in have[name] | SCRAPE_LABELS, f"{where}: {name} has no label {label!r}"
        for group in _BY.findall(expr):
            for label in filter(None, (part.strip() for part in group.split(","))):
                assert label in labels_of_expr, f"{where}: no metric in the expression has label {label!r}"
    families = {re.sub(r"_(bucket|count|sum|total)$", "", name) for name in have}
    shown = {re.sub(r"_(bucket|count|sum|total)$", "", name) for name in seen}
    assert families - shown == set(), "an exported metric is on neither the dashboard nor an alert"


def _promtool() -> str:
    path = shutil.which("promtool")
    require(path is not None, "promtool is not installed (Debian package prometheus; scripts/setup installs it)")
    assert path is not None
    return path


def test_the_rules_pass_promtool_check() -> None:
    done = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 5 rules found" in done.stdout


def test_the_rules_pass_their_unit_tests() -> None:
    done = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@pytest.mark.parametrize("alert", ["MicrovmCheckQueueStuck", "MicrovmCheckJobsFailing", "MicrovmCheckNoSpareVMs",
                                   "MicrovmCheckRunnerChurn", "MicrovmCheckGuestProtocolErrors"])
def test_every_alert_has_a_unit_test_that_expects_it_to_fire(alert: str) -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    assert any(case["alertname"] == alert and case["exp_alerts"] for t in tests for case in t["alert_rule_test"])
