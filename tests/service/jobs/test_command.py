"""Which job commands start without a shell (runner/service/jobs/command.py): only those the shell would just
split into words; the service falls back to `sh -c` for a program the guest cannot start (tests/e2e/
test_vm_e2e.py::test_passing_and_failing_commands shows that on a real guest)."""

from __future__ import annotations

import pytest

from runner.service.jobs.command import DIRECT_MAX_CHARS, direct_argv


@pytest.mark.parametrize(("command", "argv"), [
    ("true", ["true"]),
    ("false", ["false"]),
    ("pytest -q", ["pytest", "-q"]),
    ("  make\tcheck  ", ["make", "check"]),
    ("python3 run_tests.py --junit=out/report.xml", ["python3", "run_tests.py", "--junit=out/report.xml"]),
    ("./ci/run.sh a,b c:d 1+1 user@host 50%", ["./ci/run.sh", "a,b", "c:d", "1+1", "user@host", "50%"]),
])
def test_plain_words_run_as_their_argv(command: str, argv: list[str]) -> None:
    assert direct_argv(command) == argv


@pytest.mark.parametrize("command", [
    "", "   ",
    "echo hi", "pwd", "kill 1", "test -f x", "cd sub", "exit 3", "true --help", "false x", ": nothing",
    ". ./env.sh", "if", "export A=1",  # keywords and builtins: the shell's own, or not the same program
    "A=1 make", "CC=gcc",  # an assignment
    "make && make test", "a; b", "a | b", "a > out", "a < in", "a &", "(a)", "{ a; }", "! a",
    "echo $HOME", "ls ~", "ls *.py", "ls a?", "ls [ab]", "cat `x`", "a 'b c'", 'a "b"', "a\\ b",
    "make # comment", "make\nmake test", "a\rb", "a\u00a0b", "pytest -k ü",
    "-x foo", "+x foo", "--version",  # sh reads a leading - or + as its own options and runs nothing
    "x " * (DIRECT_MAX_CHARS // 2 + 1),  # long: its argv could outgrow the agent's message on the wire
])
def test_anything_the_shell_would_interpret_goes_through_it(command: str) -> None:
    assert direct_argv(command) is None
