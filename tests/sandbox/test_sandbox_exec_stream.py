"""An exec's answer is a stream (NDJSON): once its head is out, no failure may become a second status.

A bug of ours after the answer began (here: the stand-in VM raising RuntimeError after some output) was
sent to the handler, which tried a 500 in the middle of the chunked body: h11 refused it
(LocalProtocolError, a second traceback) and the client read "incomplete chunked read". Now the stream
ends with an error line that the SDK raises, the bug's traceback is logged once, and the connection
is left in order. The service runs in this process on the stand-in engine; the SDK drives it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from microvm_check import Sandbox, SandboxError
from runner.sandbox.fake import FakeSandbox, FakeSandboxes, prints
from runner.sandbox.port import ExecResult
from runner.service.host.assembly import ServiceHost


def breaks_after_output(sbx: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
    out("stdout", b"partial\n")
    raise RuntimeError("a bug of ours")


def test_a_bug_after_an_execs_answer_began_ends_it_with_an_error_line(
        hosts: Callable[..., ServiceHost], engine: FakeSandboxes, caplog: pytest.LogCaptureFixture) -> None:
    engine.programs["breaks"] = breaks_after_output
    engine.programs["fine"] = prints(b"fine\n")
    host = hosts(sandboxes={"max_live": 1, "max_per_caller": 1})
    caplog.set_level(logging.ERROR)
    output: list[bytes] = []
    with Sandbox.create(ttl_seconds=60, socket=str(host.config.socket)) as sbx:
        with pytest.raises(SandboxError) as raised:
            sbx.exec(["breaks"], on_output=lambda stream, data: output.append(data))
        after = sbx.exec(["fine"])
    assert output == [b"partial\n"]
    assert (str(raised.value), raised.value.status) == ("exec: internal error in the job service; see its log", None)
    errors = [(r.getMessage(), r.exc_info[1] if r.exc_info else None) for r in caplog.records]
    assert [(message, type(exc)) for message, exc in errors] == [
        ("api: sandbox exec failed after its answer began", RuntimeError)], errors
    assert (after.exit_code, after.stdout) == (0, b"fine\n"), "the sandbox or its API did not go on"
