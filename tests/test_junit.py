"""runner.junit reads the reports the test runners really write (reports captured from the runners here)."""

from __future__ import annotations

from pathlib import Path

from runner.junit import parse_report

FIXTURES = Path(__file__).parent / "fixtures"


def test_node_tests_written_straight_under_testsuites_are_counted():
    """node:test's junit reporter (Node 20, `--test-reporter=junit`) puts top-level tests under <testsuites>
    with no <testsuite> around them; captured from tests/action/test_action_vm_image_node.py's job."""
    totals = parse_report("node-test-junit.xml", (FIXTURES / "node-test-junit.xml").read_bytes())
    assert (totals.tests, totals.passed, totals.failed) == (2, 2, 0)


def test_a_failing_case_inside_a_describe_suite_and_one_at_the_top_are_each_counted_once():
    data = (b'<testsuites><testcase name="top"><failure message="no"/></testcase>'
            b'<testsuite name="math"><testcase name="adds"/><testsuite name="inner"><testcase name="deep"/>'
            b'</testsuite></testsuite></testsuites>')
    totals = parse_report("mixed.xml", data)
    assert (totals.tests, totals.passed, totals.failed) == (3, 2, 1)
    assert [f.suite for f in totals.failures] == [""]
