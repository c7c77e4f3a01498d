"""Reads JUnit XML reports the guest produced, which are hostile input.

Shared by the action (its annotations and outputs, action/junit.py) and the service, which reads the
same reports from a job's artifacts to sign their totals (runner/service/jobs/attestation.py) and to post
them on the pull request's check run: both count the same way.

defusedxml is not available, so the tree is built by `xml.etree.ElementTree.TreeBuilder` fed from a
raw expat parser whose DOCTYPE, entity-declaration and external-entity handlers refuse the document:
without a DTD there is no entity expansion (billion laughs) and no external fetch. Files are size-
bounded before parsing, and all text taken from them is length-bounded.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn
from xml.parsers import expat

from runner.errors import ClientError

MAX_REPORT_BYTES = 32 * 1024 * 1024
MAX_TEXT = 4000
SNIFF_BYTES = 4096
_LOCATION = re.compile(r"^([^\s:][^:\n]*):(\d+):", re.MULTILINE)


class JUnitError(ClientError):
    """A report could not be read; the message names the file and the reason."""


@dataclass(frozen=True)
class Failure:
    suite: str
    name: str
    classname: str
    kind: str  # "failure" or "error"
    message: str
    text: str
    file: str | None
    line: int | None


@dataclass
class Totals:
    tests: int = 0
    failed: int = 0  # failures and errors
    skipped: int = 0
    failures: list[Failure] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return self.tests - self.failed - self.skipped

    def add(self, other: Totals) -> None:
        self.tests += other.tests
        self.failed += other.failed
        self.skipped += other.skipped
        self.failures.extend(other.failures)


def _refuse(what: str) -> Callable[..., NoReturn]:
    def handler(*_args: object) -> NoReturn:
        raise JUnitError(f"{what} are not allowed in JUnit reports")
    return handler


def parse_xml(data: bytes) -> ET.Element:
    """Parse a bounded document with DTDs and entities refused."""
    if len(data) > MAX_REPORT_BYTES:
        raise JUnitError(f"report is {len(data)} bytes, over the {MAX_REPORT_BYTES}-byte limit")
    builder = ET.TreeBuilder()
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.StartDoctypeDeclHandler = _refuse("DOCTYPE declarations")
    parser.EntityDeclHandler = _refuse("entity declarations")
    parser.ExternalEntityRefHandler = _refuse("external entities")
    parser.StartElementHandler = builder.start
    parser.EndElementHandler = builder.end
    parser.CharacterDataHandler = builder.data
    parser.buffer_text = True
    try:
        parser.Parse(data, True)
    except expat.ExpatError as exc:
        raise JUnitError(f"not well-formed XML: {exc}") from exc
    return builder.close()


def read_report(path: Path) -> Totals:
    """Totals and failures of one JUnit file (`<testsuites>` or a bare `<testsuite>`)."""
    size = path.stat().st_size
    if size > MAX_REPORT_BYTES:
        raise JUnitError(f"{path.name}: {size} bytes, over the {MAX_REPORT_BYTES}-byte limit")
    return parse_report(path.name, path.read_bytes())


def parse_report(name: str, data: bytes) -> Totals:
    """Totals and failures of one JUnit document `data`, called `name` in errors."""
    try:
        root = parse_xml(data)
    except JUnitError as exc:
        raise JUnitError(f"{name}: {exc}") from exc
    if root.tag not in ("testsuites", "testsuite"):
        raise JUnitError(f"{name}: root element is <{_clip(root.tag, 80)}>, not <testsuites>/<testsuite>")
    totals = Totals()
    # node:test's junit reporter writes top-level tests straight under <testsuites>: they count as well
    suites = [root] if root.tag == "testsuite" else [root, *root.iter("testsuite")]
    for suite in suites:
        totals.add(_suite(suite))
    return totals


def looks_like_junit(path: Path) -> bool:
    """Cheap sniff so that non-JUnit XML artifacts are not reported as broken reports."""
    with path.open("rb") as handle:
        return head_looks_like_junit(handle.read(SNIFF_BYTES))


def head_looks_like_junit(head: bytes) -> bool:
    """`looks_like_junit` on a file's first SNIFF_BYTES bytes."""
    return b"<testsuite" in head[:SNIFF_BYTES]


def _suite(suite: ET.Element) -> Totals:
    totals = Totals()
    suite_name = _clip(suite.get("name", ""), 200)
    for case in suite.findall("testcase"):
        totals.tests += 1
        outcome = next((child for child in case if child.tag in ("failure", "error")), None)
        if outcome is not None:
            totals.failed += 1
            totals.failures.append(_failure(suite_name, case, outcome))
        elif case.find("skipped") is not None:
            totals.skipped += 1
    return totals


def _failure(suite: str, case: ET.Element, outcome: ET.Element) -> Failure:
    text = _clip(outcome.text or "", MAX_TEXT)
    file, line = case.get("file"), _int(case.get("line"))
    # The traceback's last `path:line:` is where the failure happened; a `line` attribute is only
    # where the test starts (and pytest's xunit1 writes it 0-based), so the traceback wins.
    found = _LOCATION.findall(text)
    if found:
        found_file, found_line = found[-1]
        if file is None or found_file.endswith(file) or file.endswith(found_file):
            file, line = found_file, _int(found_line)
    return Failure(
        suite=suite,
        name=_clip(case.get("name", ""), 300),
        classname=_clip(case.get("classname", ""), 300),
        kind=outcome.tag,
        message=_clip(outcome.get("message", ""), MAX_TEXT),
        text=text,
        file=_clip(file, 500) if file else None,
        line=line,
    )


def _int(value: str | None) -> int | None:
    if value is None or not re.fullmatch(r"[0-9]{1,8}", value.strip()):
        return None
    number = int(value)
    return number if 0 < number < 10_000_000 else None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
