"""How a job's command (a shell string, docs/job-api.md) is started in its guest.

Under TCG, starting `/bin/sh` costs about 50 ms of every job, more than a trivial command itself. A
command the shell would only split into words and look up on PATH (`pytest -q`, `make check`,
`python3 run_tests.py`) means the same as that argv run without a shell, so it is started as one;
everything the shell would interpret goes through `sh -c` as before: quotes, escapes, expansions
(`$`, `~`, backquotes), globs, operators and redirections, comments, newlines, an assignment as the
first word, and a first word that is one of the shell's keywords or builtins (dash's: they need not
exist as programs, and `echo`, `pwd` or `kill` behave differently when they do). Two builtins are
the same as their programs when they are the whole command: `true` and `false`.

A program the guest cannot start (not on PATH, not executable, a script without `#!`) is then
started through the shell after all (`JobRun._run_command`), which says what it says today
(`sh: 1: name: not found`, exit 127; or runs the script), so the job ends the same either way. That is
decided by the guest's answer: only an exec refused before the program started (no "started", no
output) falls back, within what is left of the step's timeout; a failure after it started is the job's.
One difference stays: when a file on PATH is not a program (a script without `#!`), the argv's exec goes
on to a later PATH entry of the same name where dash would run that file as a script.
"""

from __future__ import annotations

import re

# Characters the shell takes literally inside a word (`=` only past the first word: there it is an
# assignment). Blanks are spaces and tabs; a newline separates commands. The first word does not start
# with `-` or `+`: `sh -c "-x foo"` reads them as its own options and runs nothing.
_COMMAND = re.compile(r"[ \t]*[A-Za-z0-9_./][A-Za-z0-9_./,:+@%-]*(?:[ \t]+[A-Za-z0-9_./,:+@%=-]+)*[ \t]*")
# Past this, a command goes to the shell as it always did: an argv of many short words is up to twice
# its string on the agent's wire, and a message past guestwire's MAX_MSG cannot be sent at all.
DIRECT_MAX_CHARS = 4096
# dash's special and regular builtins and its reserved words (dash(1)); `[` and `!`, `{`, `}` cannot
# pass _COMMAND anyway.
SHELL_WORDS = frozenset({
    ".", ":", "alias", "bg", "break", "cd", "chdir", "command", "continue", "echo", "eval", "exec", "exit",
    "export", "false", "fc", "fg", "getopts", "hash", "jobs", "kill", "local", "printf", "pwd", "read",
    "readonly", "return", "set", "shift", "test", "times", "trap", "true", "type", "ulimit", "umask",
    "unalias", "unset", "wait", "case", "do", "done", "elif", "else", "esac", "fi", "for", "if", "in",
    "then", "until", "while",
})
SAME_ALONE = frozenset({"true", "false"})  # builtins whose program does the same when given no arguments


def shell_argv(command: str) -> list[str]:
    """What the guest runs for `command` through the shell."""
    return ["sh", "-c", command]


def direct_argv(command: str) -> list[str] | None:
    """The argv `command` means without a shell, or None when the shell would do more than split it."""
    if len(command) > DIRECT_MAX_CHARS or not _COMMAND.fullmatch(command):
        return None
    words = command.split()
    if words[0] in SHELL_WORDS and not (words[0] in SAME_ALONE and len(words) == 1):
        return None
    return words
