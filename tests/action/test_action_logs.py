"""Guest log relaying: nothing the guest prints may act as a workflow command on the host job."""

from __future__ import annotations

import io
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from action.logs import LogRelay, RelayLimits
from runner.jobapi.workflow import ZWSP, neutralise_line, safe_text
from tests.action.gha_runner_model import ICU_IGNORABLE, RunnerModel

HOSTILE_LINES = [
    "::set-output name=exit-code::0",
    "::add-mask::secret",
    "::add-path::/tmp/evil",
    "::set-env name=LD_PRELOAD::/tmp/evil.so",
    "::stop-commands::guess",
    "::echo::on",
    "::SET-OUTPUT name=x::1",
    "   ::save-state name=x::1",
    "\t::error file=a.py,line=1::forged annotation",
    "\u00a0::add-mask::nbsp-led",
    "\u3000\u2028::add-path::ideographic",
    "\x85::set-output name=y::nel",
    "prefix ##[set-output name=legacy;]value",
    "##[add-mask]legacy",
    "::group::fake group",
    "::endgroup::",
]


# Lines playing on ICU's ignorable characters, which culture-sensitive matching skips: each one is a
# command in at least one runner model as it stands (test_ignorable_tricks_are_commands_when_raw).
IGNORABLE_TRICKS = [
    "::set-output name=exit-code:\u200b:0",  # ICU finds the closing `::` across the ZWSP
    "x\u200b##[set-output name=a;]b",
    "::add-mask:\ufeff:bom",
    "::add-mask:\x01:control",
    "a\x01##[add-mask]ctl",
    "\u00ad##[add-mask]soft-hyphen",
    f"::add-path:{ZWSP}{ZWSP}:/tmp/x",
]


def runner_models() -> list[RunnerModel]:
    """The runner comparing ordinally (invariant globalisation) and with ICU, both ways a match may start."""
    return [RunnerModel(), RunnerModel(ignorable=ICU_IGNORABLE),
            RunnerModel(ignorable=ICU_IGNORABLE, include_leading=True)]


def relay(chunks: list[tuple[str, bytes]], limits: RelayLimits = RelayLimits()) -> tuple[str, LogRelay]:
    out = io.StringIO()
    with LogRelay(out, "check", limits) as r:
        for stream, data in chunks:
            r.feed(stream, data)
    return out.getvalue(), r


def only_our_commands(output: str) -> None:
    for model in runner_models():
        model.feed(output)
        names = [name for name, _ in model.executed]
        assert names == ["group", "stop-commands", "resume", "endgroup"], model.executed
        assert model.executed[0] == ("group", "check")


@pytest.mark.parametrize("line", HOSTILE_LINES)
def test_each_workflow_command_is_inert_inside_the_relay(line: str) -> None:
    output, _ = relay([("stdout", (line + "\n").encode())])
    only_our_commands(output)
    assert line.split("::")[-1] in output.replace(ZWSP, "")  # still readable


@pytest.mark.parametrize("line", HOSTILE_LINES + IGNORABLE_TRICKS)
def test_each_line_is_inert_even_without_stop_commands(line: str) -> None:
    for model in runner_models():
        model.feed(safe_text(line) + "\n")
        assert model.executed == []


@pytest.mark.parametrize("line", IGNORABLE_TRICKS)
def test_ignorable_tricks_are_inert_inside_the_relay(line: str) -> None:
    output, _ = relay([("stdout", (line + "\n").encode())])
    only_our_commands(output)


def test_the_model_does_execute_the_raw_lines() -> None:
    # Guards the tests above: every model recognises every hostile line when not neutralised.
    for line in HOSTILE_LINES:
        for model in runner_models():
            model.feed(line + "\n")
            assert model.executed, line


@pytest.mark.parametrize("line", IGNORABLE_TRICKS)
def test_ignorable_tricks_are_commands_when_raw(line: str) -> None:
    # Guards the trick tests: a line no model executes even raw would pass them with no neutralising.
    executed = []
    for model in runner_models():
        model.feed(line + "\n")
        executed += model.executed
    assert executed, line


def test_icu_model_matches_across_ignorables() -> None:
    # The ICU model is not the ordinal one under another name: it finds the earlier, ZWSP-split `##[`
    # (whose ordinal offsets then yield no command name), where the ordinal model finds the later one.
    line = "#\u200b#[junk ##[add-mask]x\n"
    ordinal, icu = RunnerModel(), RunnerModel(ignorable=ICU_IGNORABLE)
    ordinal.feed(line)
    icu.feed(line)
    assert ordinal.executed == [("add-mask", "x")] and icu.executed == []


def test_commands_split_across_chunks_byte_by_byte() -> None:
    data = "".join(line + "\n" for line in HOSTILE_LINES).encode()
    output, _ = relay([("stdout", data[i : i + 1]) for i in range(len(data))])
    only_our_commands(output)


def test_carriage_return_starts_a_new_line_for_the_runner() -> None:
    output, _ = relay([("stdout", b"progress 10%\r::set-output name=exit-code::0\rdone\n")])
    only_our_commands(output)
    assert "progress 10%" in output and "done" in output


def test_crlf_split_across_chunks_is_one_line_break() -> None:
    output, _ = relay([("stdout", b"a\r"), ("stdout", b"\nb\n")])
    lines = output.splitlines()
    assert lines[2:4] == ["a", "b"]


def test_a_guest_printing_the_resume_token_cannot_resume() -> None:
    out = io.StringIO()
    with LogRelay(out, "check") as r:
        token = out.getvalue().splitlines()[1].split("::")[2]
        r.feed("stdout", f"::{token}::\n::set-output name=x::1\n##[{token}]\n::add-mask::x\n"
                         f"{ZWSP}::{token}::\n::add-mask::y\n".encode())
    only_our_commands(out.getvalue())


def resume_token(output: str) -> str:
    """The token of the relay's `::stop-commands::<token>` line (its second line)."""
    line = output.splitlines()[1]
    assert line.startswith("::stop-commands::")
    return line.split("::")[2]


def test_a_token_learnt_from_an_earlier_job_cannot_resume() -> None:
    """Job logs of public repositories are public: a guest may know the token of every earlier run,
    so each relay's token must be new, not merely absent from the guest."""
    earlier, _ = relay([("stdout", b"first job\n")])
    learnt = resume_token(earlier)
    output, _ = relay([("stdout", f"::{learnt}::\n::set-output name=exit-code::0\n::add-mask::x\n".encode())])
    assert resume_token(output) != learnt
    only_our_commands(output)


def test_every_relay_draws_a_128_bit_token() -> None:
    tokens = {resume_token(relay([])[0]) for _ in range(200)}
    assert len(tokens) == 200
    assert all(re.fullmatch(r"mvc[0-9a-f]{32}", token) for token in tokens), tokens


def test_invalid_utf8_and_split_multibyte_characters() -> None:
    e_acute = "é".encode()
    output, _ = relay([("stdout", b"bad \xff\xfe bytes\n"), ("stdout", b"caf" + e_acute[:1]),
                       ("stdout", e_acute[1:] + b"\n"), ("stderr", b"\x00\x1b[31mred\x1b[0m\n")])
    assert "bad \ufffd\ufffd bytes" in output
    assert "café" in output
    assert "\x00" not in output and "\x1b[31mred" in output


def test_streams_keep_their_own_partial_lines() -> None:
    output, _ = relay([("stdout", b"out-"), ("stderr", b"err-"), ("stdout", b"line\n"), ("stderr", b"line\n")])
    assert "out-line" in output and "err-line" in output


def test_partial_last_line_is_flushed_at_the_end() -> None:
    output, _ = relay([("stdout", b"no newline ::set-output name=a::b")])
    only_our_commands(output)
    assert "no newline" in output


def test_flood_is_bounded_and_commands_still_resume() -> None:
    limits = RelayLimits(max_bytes=10_000, max_lines=100, max_line_chars=50)
    chunks = [("stdout", b"x" * 1000 + b"\n::add-mask::y\n")] * 1000
    output, r = relay(chunks, limits)
    only_our_commands(output)
    assert len(output) < 20_000
    assert r.dropped_bytes > 900_000
    assert "log truncated" in output


def test_long_lines_are_wrapped_and_each_piece_neutralised() -> None:
    limits = RelayLimits(max_line_chars=10)
    output, _ = relay([("stdout", b"0123456789::set-output name=a::b\n")], limits)
    only_our_commands(output)
    assert max(len(line) for line in output.splitlines()[2:-2]) <= 11


def test_relay_resumes_commands_when_interrupted() -> None:
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with LogRelay(out, "check") as r:
            r.feed("stdout", b"half a line")
            raise KeyboardInterrupt
    only_our_commands(out.getvalue())


def test_neutralised_text_keeps_ordinary_lines_unchanged() -> None:
    for line in ("std::vector<int> v;", "ok 1 - test", "http://[::1]:80/"):
        assert neutralise_line(line) == line


PIECES = ["::", ":", "#", "##[", "[", "]", "\r", "\n", " ", "\t", "\u00a0", "\u3000", "\x85", "\u200b", "\u00ad",
          "\ufeff", "\x01", "set-output", "add-mask", "stop-commands", "echo", "name=x", "on", "x", "é", ","]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=60), cuts=st.lists(st.integers(0, 400), max_size=8),
       raw=st.binary(max_size=20))
def test_no_mix_of_command_fragments_executes(pieces: list[str], cuts: list[int], raw: bytes) -> None:
    data = "".join(pieces).encode() + raw
    bounds = sorted({0, len(data), *[c % (len(data) + 1) for c in cuts]})
    chunks = [("stdout", data[a:b]) for a, b in zip(bounds, bounds[1:])]
    output, _ = relay(chunks)
    only_our_commands(output)
