"""Workflow command escaping and the $GITHUB_OUTPUT format."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from runner.jobapi.workflow import annotation, escape_data, escape_property, format_outputs
from tests.action.action_harness import parse_output_file
from tests.action.gha_runner_model import RunnerModel


def unescape_property(value: str) -> str:
    # The runner's UnescapeProperty order (ActionCommand.cs): %0D, %0A, %3A, %2C, then %25.
    for token, repl in (("\r", "%0D"), ("\n", "%0A"), (":", "%3A"), (",", "%2C"), ("%", "%25")):
        value = value.replace(repl, token)
    return value


def unescape_data(value: str) -> str:
    for token, repl in (("\r", "%0D"), ("\n", "%0A"), ("%", "%25")):
        value = value.replace(repl, token)
    return value


def parse_properties(line: str) -> tuple[str, dict[str, str], str]:
    """Split an annotation the way TryParseV2 does."""
    end = line.index("::", 2)
    info = line[2:end]
    name, _, props = info.partition(" ")
    pairs = {}
    for prop in filter(None, props.split(",")):
        key, _, value = prop.partition("=")
        pairs[key] = unescape_property(value)
    return name, pairs, unescape_data(line[end + 2 :])


def test_escaping_of_the_documented_characters() -> None:
    assert escape_data("100%\r\nnext") == "100%25%0D%0Anext"
    assert escape_property("a:b,c%\n") == "a%3Ab%2Cc%25%0A"


@given(file=st.text(max_size=40), title=st.text(max_size=40), message=st.text(max_size=80),
       line=st.integers(1, 10**6))
def test_annotations_round_trip_through_the_runner_parser(file: str, title: str, message: str, line: int) -> None:
    text = annotation("error", message, file=file, line=line, title=title)
    assert "\n" not in text and "\r" not in text
    name, props, data = parse_properties(text)
    assert name == "error"
    assert props.get("file", "") == file and props.get("title", "") == title and props["line"] == str(line)
    assert data == message
    model = RunnerModel()
    model.feed(text + "\n")
    assert [n for n, _ in model.executed] == ["error"]


def test_a_forged_newline_in_a_message_cannot_start_a_command() -> None:
    text = annotation("error", "boom\n::add-mask::x\r::set-output name=a::b", file="a,b:c.py")
    model = RunnerModel()
    model.feed(text + "\n")
    assert [n for n, _ in model.executed] == ["error"]


@given(value=st.text(alphabet=st.characters(blacklist_characters="\r", blacklist_categories=("Cs",)), max_size=200))
def test_outputs_round_trip_with_random_delimiters(value: str) -> None:
    text = format_outputs({"result-json": value, "exit-code": "3"})
    assert parse_output_file(text) == {"result-json": value, "exit-code": "3"}


def test_a_value_cannot_forge_another_output() -> None:
    hostile = "x\nghadelimiter_0\nexit-code=0\nexit-code<<EOF\n0\nEOF"
    text = format_outputs({"result-json": hostile, "exit-code": "1"})
    assert parse_output_file(text) == {"result-json": hostile, "exit-code": "1"}
    assert re.match(r"result-json<<ghadelimiter_[0-9a-f]{32}\n", text)
