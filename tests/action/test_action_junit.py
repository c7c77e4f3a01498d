"""JUnit parsing: real pytest reports, hostile XML, annotations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from action.junit import MAX_REPORT_BYTES, JUnitError, parse_xml, read_report
from action.summary import annotations
from tests.action.gha_runner_model import RunnerModel

SUITE = '''
import pytest

def test_ok():
    assert 1 + 1 == 2

def test_fails():
    assert "a,b:c%" == "d"

def test_errors(missing_fixture):
    pass

@pytest.mark.skip(reason="later")
def test_skipped():
    pass
'''


@pytest.fixture(params=["xunit1", "xunit2"])
def pytest_report(request, tmp_path: Path) -> Path:
    """A report written by the real pytest, in both junit families it supports."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(SUITE)
    report = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                    "-o", f"junit_family={request.param}", "tests"], cwd=tmp_path, capture_output=True)
    return report


def test_totals_and_failures_of_a_real_pytest_report(pytest_report: Path) -> None:
    totals = read_report(pytest_report)
    assert (totals.tests, totals.passed, totals.failed, totals.skipped) == (4, 1, 2, 1)
    by_name = {f.name: f for f in totals.failures}
    assert by_name["test_fails"].kind == "failure"
    assert by_name["test_errors"].kind == "error"
    assert by_name["test_fails"].file == "tests/test_sample.py"
    assert by_name["test_fails"].line == 8


def test_annotations_point_at_the_repository_path(pytest_report: Path) -> None:
    lines = annotations(read_report(pytest_report).failures, prefix="sub/dir/")
    model = RunnerModel()
    model.feed("\n".join(lines) + "\n")
    assert [name for name, _ in model.executed] == ["error", "error"]
    fails = next(line for line in lines if "test_fails" in line)
    assert fails.startswith("::error file=sub/dir/tests/test_sample.py,line=8,title=")


def test_refuses_entity_expansion(tmp_path: Path) -> None:
    laughs = b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;">]>' \
             b'<testsuite><testcase name="&lol2;"/></testsuite>'
    with pytest.raises(JUnitError, match="DOCTYPE"):
        parse_xml(laughs)


def test_refuses_external_entities(tmp_path: Path) -> None:
    xxe = b'<?xml version="1.0"?><!DOCTYPE t [<!ENTITY x SYSTEM "file:///etc/passwd">]><testsuite name="&x;"/>'
    with pytest.raises(JUnitError, match="^DOCTYPE declarations are not allowed in JUnit reports$"):
        parse_xml(xxe)


def test_refuses_doctype_in_utf16(tmp_path: Path) -> None:
    doc = '<?xml version="1.0" encoding="UTF-16"?><!DOCTYPE t SYSTEM "http://127.0.0.1:1/x.dtd"><testsuite/>'
    with pytest.raises(JUnitError, match="DOCTYPE"):
        parse_xml(doc.encode("utf-16"))


def test_undefined_entity_is_an_error() -> None:
    with pytest.raises(JUnitError, match="well-formed"):
        parse_xml(b"<testsuite name='&secret;'/>")


def test_oversized_report_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.xml"
    with big.open("wb") as handle:
        handle.write(b"<testsuite>")
        handle.truncate(MAX_REPORT_BYTES + 1)
    with pytest.raises(JUnitError, match="limit"):
        read_report(big)


def test_deep_nesting_does_not_crash(tmp_path: Path) -> None:
    deep = tmp_path / "deep.xml"
    deep.write_bytes(b"<testsuites>" + b"<a>" * 200_000 + b"</a>" * 200_000 + b"</testsuites>")
    assert read_report(deep).tests == 0


def test_not_junit_and_hostile_values(tmp_path: Path) -> None:
    other = tmp_path / "other.xml"
    other.write_text("<project/>")
    with pytest.raises(JUnitError, match="root element"):
        read_report(other)
    hostile = tmp_path / "hostile.xml"
    hostile.write_text('<testsuites><testsuite name="s"><testcase name="t" classname="c" file="/etc/passwd" '
                       'line="999999999999"><failure message="m&#10;::add-mask::x">' + "y" * 100_000 +
                       '</failure></testcase></testsuite></testsuites>')
    failure = read_report(hostile).failures[0]
    assert failure.line is None and len(failure.text) <= 4000
    lines = annotations([failure])
    model = RunnerModel()
    model.feed("\n".join(lines) + "\n")
    assert [name for name, _ in model.executed] == ["error"]


def test_annotation_count_is_bounded(tmp_path: Path) -> None:
    cases = "".join(f'<testcase name="t{i}"><failure message="m"/></testcase>' for i in range(30))
    report = tmp_path / "many.xml"
    report.write_text(f"<testsuite>{cases}</testsuite>")
    lines = annotations(read_report(report).failures)
    assert len(lines) == 11 and "20 more failed tests" in lines[-1]
