"""The sandbox API's contract (microvm_check/contract.py): every record comes back from its own wire form
as it was, what comes over the wire off the contract is refused naming the field, and the module stays
what the service may import: the standard library only, nothing declared twice."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from microvm_check import _wire, contract
from microvm_check._wire import SandboxError
from microvm_check.contract import (
    CreateAnswer,
    CreateRequest,
    DestroyAnswer,
    ErrorAnswer,
    ExecEnd,
    ExecOutput,
    ExecRequest,
    FileEntry,
    Listing,
    Route,
    SandboxInfo,
    SnapshotAnswer,
    WireError,
    exec_line,
    sandbox_path,
)
from microvm_check.entries import AuditRecord

SANDBOX = "j0123456789abcdef"
INFO = SandboxInfo(id=SANDBOX, template="base", base="sbx-j0123456789abcdef-1", state="running",
                   repository="org/sandboxes", vm_id="vm-1", ttl_seconds=600.0, expires_in=599.5, accel="kvm",
                   ready_ms=41.5)
RECORDS = [
    CreateRequest(), CreateRequest("base", "sbx-j0123456789abcdef-1", "version: 1\n", 60.0),
    ExecRequest("echo hi"), ExecRequest(("ls", "-l"), 30.0, "/tmp", {"A": "b"}),
    INFO, CreateAnswer(INFO, "t" * 43),
    ExecOutput("stderr", b"\x00\xffbytes"),
    ExecEnd(3, True, True, 12.5, (AuditRecord("203.0.113.9", 443, "tcp", "example.com", 2),)),
    ErrorAnswer("sandbox j0123456789abcdef has ended: its VM failed"),
    Listing("/workspace", (FileEntry("src", "dir", 0), FileEntry("a.txt", "file", 5)), True),
    SnapshotAnswer("sbx-j0123456789abcdef-1"), DestroyAnswer(SANDBOX),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_each_record_comes_back_from_its_json_as_it_was(record: object) -> None:
    wire = json.loads(json.dumps(record.to_wire()))  # type: ignore[attr-defined]
    assert type(record).from_wire(wire) == record  # type: ignore[attr-defined]


def test_the_wire_keeps_the_fields_old_clients_read() -> None:
    """JSON stays as the routes answered it before the contract: old SDKs read these keys."""
    assert set(CreateAnswer(INFO, "t" * 43).to_wire()) >= {"id", "vm_id", "repository", "template", "base",
                                                           "expires_in", "accel", "ready_ms", "token"}
    assert ExecOutput("stdout", b"hi").to_wire() == {"stream": "stdout", "data": "aGk="}
    assert set(ExecEnd(0).to_wire()) == {"exit_code", "timed_out", "truncated", "duration_ms", "blocked_egress"}
    assert Listing("/w", (FileEntry("a", "file", 1),)).to_wire() == {
        "path": "/w", "entries": [{"name": "a", "type": "file", "size": 1}], "truncated": False}
    assert SnapshotAnswer("s").to_wire() == {"base": "s"}
    assert DestroyAnswer(SANDBOX).to_wire() == {"destroyed": True, "id": SANDBOX}
    assert CreateRequest(ttl_seconds=60).to_wire() == {"ttl_seconds": 60}
    assert ExecRequest(["a"]).to_wire() == {"command": ["a"], "cwd": "/workspace", "env": {}}  # type: ignore[arg-type]


OFF_CONTRACT = [  # (record, what came, the field the refusal names)
    (SandboxInfo, [], "sandbox info"),
    (SandboxInfo, {**INFO.to_wire(), "id": "../jobs"}, "id"),
    (SandboxInfo, {**INFO.to_wire(), "template": 5}, "template"),
    (SandboxInfo, {**INFO.to_wire(), "ttl_seconds": True}, "ttl_seconds"),
    (SandboxInfo, {**INFO.to_wire(), "expires_in": float("nan")}, "expires_in"),
    (SandboxInfo, {k: v for k, v in INFO.to_wire().items() if k != "state"}, "state"),
    (CreateAnswer, INFO.to_wire(), "token"),
    (CreateAnswer, {**INFO.to_wire(), "token": "x\r\nX-Other: 1" + "a" * 20}, "token"),
    (ExecOutput, {"stream": "system", "data": ""}, "stream"),
    (ExecOutput, {"stream": "stdout", "data": "not base64!"}, "data"),
    (ExecEnd, {"exit_code": "0"}, "exit_code"),
    (ExecEnd, {"exit_code": 0, "timed_out": "no"}, "timed_out"),
    (ExecEnd, {"exit_code": 0, "blocked_egress": ["x"]}, "blocked_egress"),
    (ErrorAnswer, {"error": ["x"]}, "error"),
    (FileEntry, {"name": "a", "type": "socket", "size": 1}, "type"),
    (FileEntry, {"name": "a", "type": "file", "size": -1}, "size"),
    (FileEntry, {"name": "a" * 4097, "type": "file", "size": 1}, "name"),
    (Listing, {"path": "/w", "entries": {}}, "entries"),
    (SnapshotAnswer, {"base": None}, "base"),
    (DestroyAnswer, {"destroyed": True}, "id"),
    (CreateRequest, {"tmpl": "base"}, "unknown field(s) tmpl"),
    (CreateRequest, {"ttl_seconds": 0}, "ttl_seconds"),
    (CreateRequest, {"policy": "x" * (64 * 1024 + 1)}, "policy"),
    (ExecRequest, {"command": ""}, "command"),
    (ExecRequest, {"command": ["ls", 1]}, "command"),
    (ExecRequest, {"command": "x" * (256 * 1024 + 1)}, "command"),
    (ExecRequest, {"command": "ls", "timeout_seconds": -1}, "timeout_seconds"),
    (ExecRequest, {"command": "ls", "env": {"A": 1}}, "env"),
    (ExecRequest, {"command": "ls", "cwd": None}, "cwd"),
]


@pytest.mark.parametrize(("record", "data", "field"), OFF_CONTRACT,
                         ids=[f"{r.__name__}-{f}" for r, _, f in OFF_CONTRACT])
def test_what_comes_off_the_contract_is_refused_naming_the_field(record: type, data: object, field: str) -> None:
    with pytest.raises(WireError) as refused:
        record.from_wire(data)
    assert str(refused.value).startswith(field), refused.value


def test_an_exec_line_is_read_by_what_it_carries() -> None:
    assert exec_line({"stream": "stdout", "data": "aGk="}) == ExecOutput("stdout", b"hi")
    assert exec_line({"error": "gone"}) == ErrorAnswer("gone")
    assert exec_line({"exit_code": 0}) == ExecEnd(0)


def test_a_path_is_built_only_for_a_sandbox_id() -> None:
    assert sandbox_path(SANDBOX, Route.FILES_LIST) == f"/v1/sandboxes/{SANDBOX}/files/list"
    with pytest.raises(WireError):
        sandbox_path("../../v1/jobs")


def test_the_sdk_raises_an_answer_off_the_contract_as_a_sandbox_error() -> None:
    """Not a KeyError or a JSONDecodeError from deep inside: the caller catches one error type."""
    call = _wire.snapshot_call(SANDBOX)
    for body in (b"not json", b'{"name": "s"}', b"[]"):
        with pytest.raises(SandboxError, match="not the sandbox API's") as raised:
            _wire.answer_of(call, body, SnapshotAnswer.from_wire)
        assert raised.value.status is None
    reader = _wire.ExecReader(None, 1024)
    with pytest.raises(SandboxError, match="stream"):
        reader.line(b'{"stream": "stdin", "data": ""}')
    assert _wire.error_of(call, 502, b"<html>bad gateway</html>").status == 502


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["contract.py", "entries.py"])
def test_the_contract_imports_nothing_but_the_standard_library(module: str) -> None:
    """The service imports it (import-linter keeps it to this one module of the SDK, and the record
    entries it carries, microvm_check/entries.py, checked here too); an import of httpx or of the SDK's
    clients here would bring them into the service. import-linter's graph has no external packages, so
    this reads the module's imports."""
    tree = ast.parse((ROOT / "microvm_check" / module).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported -= {"microvm_check.entries"}  # standard library only too: the other parameter
    assert imported and {name.split(".")[0] for name in imported} <= sys.stdlib_module_names | {"__future__"}, \
        imported


def test_the_service_importing_the_contract_loads_no_client() -> None:
    """At run time too: the package's names load when first used, so the contract brings no httpx."""
    probe = "import sys, microvm_check.contract; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = set(done.stdout.split())
    assert "microvm_check.contract" in loaded and "httpx" not in loaded, loaded
    assert not loaded & {"microvm_check._wire", "microvm_check.client", "microvm_check.aio"}, loaded
    import microvm_check

    assert all(hasattr(microvm_check, name) for name in microvm_check.__all__)


def test_the_names_the_job_api_shares_are_the_same() -> None:
    """A sandbox is a job record (its id a job id), on the job API's socket."""
    from runner.jobapi import contract as jobapi

    assert contract.DEFAULT_SOCKET == jobapi.DEFAULT_SOCKET
    assert contract.SANDBOX_ID.pattern == jobapi.JOB_ID.pattern


# -- a terminal's stream (issue 37) -----------------------------------------------------------------


def test_terminal_frames_come_back_whole_however_the_bytes_are_cut() -> None:
    from microvm_check.contract import (
        CLIENT_KINDS,
        INPUT,
        MAX_FRAME,
        RESIZE,
        FrameDecoder,
        encode_frame,
        encode_frames,
        resize_payload,
    )

    data = encode_frames(INPUT, b"x" * (MAX_FRAME + 10)) + encode_frame(RESIZE, resize_payload(33, 111))
    decoder = FrameDecoder(CLIENT_KINDS)
    frames = []
    for i in range(0, len(data), 7):  # fed in small pieces, as a connection may deliver them
        decoder.feed(data[i : i + 7])
        while (frame := decoder.next()) is not None:
            frames.append(frame)
    assert [(f.kind, len(f.payload)) for f in frames] == [(INPUT, MAX_FRAME), (INPUT, 10), (RESIZE, 6)]
    assert not decoder.partial and encode_frames(INPUT, b"") == b""


@pytest.mark.parametrize(("data", "why"), [
    (b"z\x00\x00\x00\x01z", "unknown terminal frame kind"),
    (b"o\x00\x00\x00\x01o", "unknown terminal frame kind"),  # a service's kind, from a client
    (b"i\x00\x01\x00\x01", "over"),  # refused from its header, before its payload is waited for
])
def test_a_terminal_frame_off_the_rules_is_refused_from_its_header(data: bytes, why: str) -> None:
    from microvm_check.contract import CLIENT_KINDS, FrameDecoder, FrameError

    decoder = FrameDecoder(CLIENT_KINDS, data)
    with pytest.raises(FrameError, match=why):
        decoder.next()


def test_a_stream_that_ends_inside_a_frame_is_refused() -> None:
    from microvm_check.contract import SERVICE_KINDS, FrameError, FrameReader

    parts = [b"o\x00\x00\x00\x05ab", b""]
    with pytest.raises(FrameError, match="inside a frame"):
        FrameReader(lambda _n: parts.pop(0), SERVICE_KINDS).next()
    assert FrameReader(lambda _n: b"", SERVICE_KINDS).next() is None


@pytest.mark.parametrize(("size", "why"), [(b"0x80", "out of range"), (b"24x1001", "out of range"),
                                           (b"24*80", "ROWSxCOLS"), (b"-1x5", "ROWSxCOLS"),
                                           (b"999999x1", "ROWSxCOLS")])
def test_a_terminal_size_is_held_to_the_guests_bounds(size: bytes, why: str) -> None:
    from microvm_check.contract import FrameError, parse_size

    assert parse_size(b"33x111") == (33, 111)
    with pytest.raises(FrameError, match=why):
        parse_size(size)


def test_a_terminal_request_and_end_come_back_as_they_were() -> None:
    from microvm_check.contract import TerminalEnd, TerminalRequest

    request = TerminalRequest(("sh", "-c", "tty"), 33, 111, "/tmp", {"A": "b=c"})
    query: dict[str, list[str]] = {}
    for name, value in request.to_query():
        query.setdefault(name, []).append(value)
    assert TerminalRequest.from_query(query) == request
    assert TerminalRequest.from_query({}) == TerminalRequest()
    for end in (TerminalEnd(3), TerminalEnd(None, killed=True), TerminalEnd(error="the VM went")):
        assert TerminalEnd.of_frame(json.dumps(end.to_wire()).encode()) == end
    assert TerminalEnd(0).to_wire() == {"exit_code": 0, "timed_out": False, "killed": False}  # the job API's EXIT


@pytest.mark.parametrize(("query", "field"), [
    ({"argv": ["a\x00b"]}, "argv"), ({"env": ["A"]}, "env"), ({"env": ["A=1", "A=2"]}, "env"),
    ({"cwd": ["tmp"]}, "cwd"), ({"size": ["1x0"]}, "a terminal of"), ({"user": ["root"]}, "unknown parameter"),
    ({"argv": ["x" * (256 * 1024 + 1)]}, "command"),
])
def test_a_terminal_request_off_the_contract_is_refused_naming_the_field(query: dict[str, list[str]],
                                                                         field: str) -> None:
    from microvm_check.contract import TerminalRequest

    with pytest.raises(WireError) as refused:
        TerminalRequest.from_query(query)
    assert str(refused.value).startswith(field), refused.value


@pytest.mark.parametrize("payload", [b"not json", b"[]", b'{"exit_code": "0"}', b'{"exit_code": 0, "killed": 1}'])
def test_an_exit_frame_that_is_no_terminal_end_is_refused(payload: bytes) -> None:
    from microvm_check.contract import FrameError, TerminalEnd

    with pytest.raises(FrameError, match="EXIT"):
        TerminalEnd.of_frame(payload)


def test_the_sdk_reads_a_terminals_stream_to_its_end_and_nothing_past_it() -> None:
    from microvm_check.contract import EXIT, OUTPUT, encode_frame

    reader = _wire.TerminalReader("terminal")
    data = encode_frame(OUTPUT, b"\x1b]0;raw\x07") + encode_frame(EXIT, b'{"exit_code": 2}')
    assert reader.feed(data[:3]) == [] and reader.feed(data[3:]) == [b"\x1b]0;raw\x07"]
    assert reader.end is not None and reader.end.exit_code == 2 and reader.feed(b"") == []
    with pytest.raises(SandboxError, match="after the EXIT"):
        reader.feed(encode_frame(OUTPUT, b"late"))
    with pytest.raises(SandboxError, match="closed the terminal inside a frame"):
        early = _wire.TerminalReader("terminal")
        early.feed(data[:3])
        early.feed(b"")
    with pytest.raises(SandboxError, match="not a terminal's"):
        _wire.TerminalReader("terminal").feed(encode_frame(b"i", b"typed"))


def test_an_exec_carries_its_stdin_and_the_signals_are_the_guests() -> None:
    from microvm_check.contract import MAX_SIDE, TERMINAL_SIGNALS
    from runner.vm.guestwire import PTY_MAX_SIDE, PTY_SIGNALS

    assert ExecRequest.from_wire(ExecRequest("cat", stdin=b"\x00in").to_wire()).stdin == b"\x00in"
    assert "stdin" not in ExecRequest("cat").to_wire()
    with pytest.raises(WireError, match="stdin"):
        ExecRequest.from_wire({"command": "cat", "stdin": "not base64!"})
    assert set(TERMINAL_SIGNALS) == set(PTY_SIGNALS) and MAX_SIDE == PTY_MAX_SIDE


# review: bounds of the contract a mutation could drop unnoticed (each failed on one that did)
_ENTRY = {"name": "a", "type": "file", "size": 1}
BOUNDS = [  # (record, what came, the field the refusal names)
    (CreateAnswer, {**INFO.to_wire(), "token": "a" * 15}, "token"),
    (CreateAnswer, {**INFO.to_wire(), "token": "a" * 129}, "token"),
    (CreateAnswer, {**INFO.to_wire(), "token": "a" * 20 + " :\r"}, "token"),
    (ExecEnd, {"exit_code": 0, "blocked_egress": [{}] * 101}, "blocked_egress"),
    (ExecRequest, {"command": "ls", "stdin": "AAAA" * ((512 * 1024 + 2) // 3 + 1)}, "stdin"),
    (Listing, {"path": "/w", "entries": [_ENTRY] * 10_001}, "entries"),
]


@pytest.mark.parametrize(("record", "data", "field"), BOUNDS, ids=[f"{r.__name__}-{f}-{i}" for i, (r, _, f) in enumerate(BOUNDS)])
def test_what_is_past_a_bound_is_refused_naming_the_field(record: type, data: object, field: str) -> None:
    with pytest.raises(WireError) as refused:
        record.from_wire(data)
    assert str(refused.value).startswith(field), refused.value


def test_the_bounds_themselves_are_taken() -> None:
    assert CreateAnswer.from_wire({**INFO.to_wire(), "token": "a" * 16}).token == "a" * 16
    assert len(ExecEnd.from_wire({"exit_code": 0, "blocked_egress": [{}] * 100}).blocked_egress) == 0
    assert ExecRequest.from_wire({"command": "ls", "stdin": "AAAA" * (512 * 1024 // 3) + "AAA="}).stdin is not None
    assert len(Listing.from_wire({"path": "/w", "entries": [_ENTRY] * 10_000}).entries) == 10_000


def test_stdin_is_held_to_max_stdin_bytes_not_only_to_its_base64_length() -> None:
    """(MAX_STDIN + 2) // 3 * 4 characters of base64 decode to a byte past MAX_STDIN: the SDK
    refuses them (microvm_check._wire), the service's contract now too."""
    import base64

    from microvm_check.contract import MAX_STDIN
    assert ExecRequest.from_wire({"command": "ls", "stdin": base64.b64encode(b"x" * MAX_STDIN).decode()}).stdin
    with pytest.raises(WireError, match="^stdin: .* at most 524288 bytes, got 524289"):
        ExecRequest.from_wire({"command": "ls", "stdin": base64.b64encode(b"x" * (MAX_STDIN + 1)).decode()})
