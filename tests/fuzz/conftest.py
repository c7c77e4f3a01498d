"""Bounded, fixed-seed fuzz tests: hostile inputs against the loaders and decoders that take them.

What runs here (issue 13): the service config loader (mutations of the example in docs/job-api.md
and of valid configs, as text and as Python values) and the host's side of the guest protocol
(frame reading and message decoding, as a hostile guest on a socketpair would drive them). Each
target asserts its contract for every input: a result or the module's own error (with a file:line
for configs, a broken channel for the agent), never another exception, never an unbounded message.
And the two listeners, each through its real socket with the service on the fake engine: the job API
(Unix socket, and TCP with the token) and the GitHub webhook (signed mutations of the stored real
payloads, and garbled framing). For every request: no 5xx but a 503 with Retry-After, no traceback
in the log; after the batch, a valid request is answered within a second and the process is back to
its threads and file descriptors (wire.py has what the two share).

Hypothesis runs derandomized (a fixed seed from each test's name), without deadlines and without an
example database, so a run is the same on every machine and CI never flakes on a new example.
The default counts keep the whole directory within about 40 s on this project's 2-core machines.

    .venv/bin/pytest -q -p no:cacheprovider tests/fuzz                          # the bounded run
    FUZZ_EXAMPLES=20000 .venv/bin/pytest -q -p no:cacheprovider tests/fuzz      # longer: N per target
    FUZZ_SEED=7 FUZZ_EXAMPLES=20000 .venv/bin/pytest -q -p no:cacheprovider tests/fuzz  # other inputs

The number of inputs each target ran is printed in pytest's summary ("fuzz inputs: ...").
"""

from __future__ import annotations

import pytest

from tests.fuzz.fuzzing import INPUTS


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under xdist, a worker's counts go to the controller, which prints them (tests/conftest.py)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["fuzz_inputs"] = dict(INPUTS)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if INPUTS:
        counts = ", ".join(f"{name}={count}" for name, count in sorted(INPUTS.items()))
        terminalreporter.write_line(f"fuzz inputs: {counts} (total {sum(INPUTS.values())})")
