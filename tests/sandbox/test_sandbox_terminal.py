"""The SDK's `terminal()` and `exec(stdin=...)` through a real service's sandbox routes on the stand-in engine
(issue 37): the terminal's frames both ways (input, resize, a signal, the exit status), the raw output,
detaching, the output budget, a request without the Upgrade, and the asyncio twin; a frame off the
stream's rules ends the session. A terminal in a real VM: tests/e2e/test_vm_sdk_terminal.py."""

from __future__ import annotations

import asyncio
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from microvm_check import AsyncSandbox, Sandbox, SandboxError, Service
from microvm_check.contract import SANDBOX_TOKEN_HEADER, TERMINAL_UPGRADE
from runner.sandbox.fake import FakeSandbox, FakeSandboxes, prints
from runner.service.host.assembly import ServiceHost
from runner.vm.agent import ExecOutcome

ESC_TITLE = b"\x1b]0;title\x07"  # a program reading the terminal gets the bytes as they came, not filtered


class FakeTerminal:
    """A program on a pty: it says how it was started, echoes what is typed, says its size on a resize, ends
    130 on SIGINT, with the number after "exit " typed, or killed when ended from the host; "flood" writes
    a lot."""

    def __init__(self, argv: list[str], cwd: str, env: dict[str, str], size: tuple[int, int]) -> None:
        self.argv, self.cwd, self.env, self.size = argv, cwd, env, size
        self.chunks: queue.Queue[bytes | None] = queue.Queue()
        self.outcome: ExecOutcome | None = None
        self._ending: ExecOutcome | None = None
        self.ended_from_host = threading.Event()
        self.closed = False
        self.chunks.put(f"argv={argv} cwd={cwd} TERM={env.get('TERM')} size={size[0]}x{size[1]}\n".encode() + ESC_TITLE)

    def output(self) -> Iterator[bytes]:
        while (chunk := self.chunks.get()) is not None:
            yield chunk
        self.outcome = self._ending

    def _exit(self, code: int, killed: bool = False) -> None:
        self._ending = ExecOutcome(code, False, killed)
        self.chunks.put(None)

    def write(self, data: bytes) -> None:
        self.chunks.put(data)
        if data.startswith(b"exit "):
            self._exit(int(data.split()[1]))
        elif data == b"flood":
            for _ in range(64):
                self.chunks.put(b"x" * 1024)

    def resize(self, rows: int, cols: int) -> bool:
        self.size = (rows, cols)
        self.chunks.put(f"size {rows} {cols}\n".encode())
        return True

    def signal(self, name: str) -> bool:
        if name == "INT":
            self._exit(130)
        return True

    def end(self) -> None:
        self.ended_from_host.set()
        if self._ending is None:
            self._exit(-9, killed=True)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def terminals(monkeypatch: pytest.MonkeyPatch) -> list[FakeTerminal]:
    opened: list[FakeTerminal] = []

    def terminal(self: FakeSandbox, argv: list[str], cwd: str = "/workspace", env: dict[str, str] | None = None,
                 size: tuple[int, int] = (24, 80), timeout_seconds: float = 3600.0,
                 user: str | None = None) -> FakeTerminal:
        opened.append(FakeTerminal(argv, cwd, dict(env or {}), size))
        return opened[-1]

    monkeypatch.setattr(FakeSandbox, "terminal", terminal)
    return opened


@pytest.fixture
def service(hosts: Callable[..., ServiceHost], engine: FakeSandboxes) -> Service:
    engine.programs["echo alive"] = prints(b"alive\n")
    engine.programs["cat"] = prints(b"")
    host = hosts(sandboxes={"exec_output_bytes": 16 * 1024})
    return Service(socket=str(host.config.socket))


def read_until(term: object, needle: bytes) -> bytes:
    seen = b""
    while needle not in seen:
        chunk = term.read(30)  # type: ignore[attr-defined]
        assert chunk, f"the terminal ended before {needle!r}: {seen!r}"
        seen += chunk
    return seen


def test_a_terminal_streams_both_ways_and_the_sandbox_lives_on(service: Service, terminals: list[FakeTerminal],
                                                               engine: FakeSandboxes) -> None:
    with Sandbox.create(ttl_seconds=60, service=service) as sbx:
        with sbx.terminal(["prog", "-x"], rows=30, cols=100, env={"A": "b"}) as term:
            hello = read_until(term, ESC_TITLE)
            assert b"argv=['prog', '-x'] cwd=/workspace TERM=xterm-256color size=30x100" in hello
            assert terminals[0].env["A"] == "b"
            term.write("typed\n")
            read_until(term, b"typed\n")
            term.resize(33, 111)
            read_until(term, b"size 33 111\n")
            term.signal("INT")
            end = term.wait(30)
            assert end.exit_code == 130 and term.exit_code == 130 and not end.killed
            assert term.read() == b"" and list(term) == []
        assert terminals[0].closed
        with sbx.terminal() as shell:  # no program named: the sandbox's shell, on sh
            read_until(shell, ESC_TITLE)
            shell.write("exit 7\n")
            assert shell.wait(30).exit_code == 7
        assert terminals[1].argv[:2] == ["/bin/sh", "-c"] and "bash -i" in terminals[1].argv[2]
        assert sbx.exec("echo alive", timeout=30).stdout == b"alive\n"
        ran = sbx.exec(["cat"], timeout=30, stdin=b"some input\n")
        assert ran.exit_code == 0
        assert engine.created[0].exec_calls[-1]["stdin"] == b"some input\n"
        with pytest.raises(SandboxError, match="stdin"):
            sbx.exec(["cat"], stdin=b"x" * (512 * 1024 + 1))
        with pytest.raises(SandboxError, match="no signal"):
            with sbx.terminal(["prog"]) as term:
                term.signal("USR1")


def test_closing_a_terminal_detaches_and_ends_its_program_only(service: Service, terminals: list[FakeTerminal],
                                                               engine: FakeSandboxes) -> None:
    with Sandbox.create(ttl_seconds=60, service=service) as sbx:
        term = sbx.terminal(["prog"])
        read_until(term, ESC_TITLE)
        term.close()
        assert terminals[0].ended_from_host.wait(30), "detaching did not end the program"
        with pytest.raises(SandboxError, match="closed"):
            term.write("late")
        assert sbx.exec("echo alive", timeout=30).exit_code == 0 and engine.created[0].alive


def test_a_terminal_past_the_output_budget_ends_with_the_reason(service: Service,
                                                                terminals: list[FakeTerminal]) -> None:
    with Sandbox.create(ttl_seconds=60, service=service) as sbx:
        with sbx.terminal(["prog"]) as term:
            term.write("flood")
            with pytest.raises(SandboxError, match="exec_output_bytes"):
                term.wait(30)
            assert term.end is not None and term.end.error is not None


def test_a_terminal_needs_the_upgrade_and_a_good_query(service: Service, terminals: list[FakeTerminal]) -> None:
    with Sandbox.create(ttl_seconds=60, service=service) as sbx:
        transport = httpx.HTTPTransport(uds=service.socket)
        with httpx.Client(transport=transport, base_url="http://localhost",
                          headers={SANDBOX_TOKEN_HEADER: sbx.token}) as http:
            plain = http.get(f"/v1/sandboxes/{sbx.id}/terminal")
            assert plain.status_code == 400 and TERMINAL_UPGRADE in plain.text
            upgrade = {"Upgrade": TERMINAL_UPGRADE, "Connection": "Upgrade"}
            for query, field in (({"size": "0x80"}, "out of range"), ({"cwd": "relative"}, "cwd"),
                                 ({"env": "NOEQUALS"}, "env"), ({"other": "1"}, "unknown parameter")):
                refused = http.get(f"/v1/sandboxes/{sbx.id}/terminal", params=query, headers=upgrade)
                assert refused.status_code == 400 and field in refused.text, (query, refused.text)
        assert terminals == [], "a refused request started a program"
        with pytest.raises(SandboxError, match="rows and cols"):
            sbx.terminal(rows=0)


def test_a_frame_off_the_rules_ends_the_session(service: Service, terminals: list[FakeTerminal]) -> None:
    """An unknown kind, then a header announcing more than MAX_FRAME: the session ends, its program with it."""
    with Sandbox.create(ttl_seconds=60, service=service) as sbx:
        for bad in (struct.pack(">cI", b"z", 1) + b"z", struct.pack(">cI", b"i", 1 << 30)):
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(30)
                sock.connect(str(Path(str(service.socket))))
                sock.sendall(f"GET /v1/sandboxes/{sbx.id}/terminal HTTP/1.1\r\nHost: x\r\n{SANDBOX_TOKEN_HEADER}: "
                             f"{sbx.token}\r\nUpgrade: {TERMINAL_UPGRADE}\r\nConnection: Upgrade\r\n\r\n".encode())
                head = b""
                while b"\r\n\r\n" not in head:
                    head += sock.recv(4096)
                assert head.startswith(b"HTTP/1.1 101"), head
                sock.sendall(bad)
                rest = b""
                while chunk := sock.recv(65536):
                    rest += chunk
                assert b'"killed": true' in rest, rest  # EXIT: the program was ended from the host
            assert terminals[-1].ended_from_host.is_set()
        assert sbx.exec("echo alive", timeout=30).exit_code == 0


def test_the_async_terminal_does_the_same(service: Service, terminals: list[FakeTerminal]) -> None:
    async def drive() -> tuple[int | None, bytes]:
        async with await AsyncSandbox.create(ttl_seconds=60, service=service) as sbx:
            async with await sbx.terminal(["prog"], rows=40, cols=120) as term:
                seen = b""
                while b"title" not in seen:
                    seen += await term.read(30)
                await term.resize(50, 60)
                await term.write(b"typed\n")
                while b"typed" not in seen:
                    seen += await term.read(30)
                await term.signal("INT")
                async for chunk in term:
                    seen += chunk
                end = await term.wait(30)
            ran = await sbx.exec(["cat"], timeout=30, stdin="via asyncio")
            assert ran.exit_code == 0
            return end.exit_code, seen

    code, seen = asyncio.run(drive())
    assert code == 130 and b"size=40x120" in seen and b"size 50 60" in seen, seen


def test_one_thread_reads_while_another_types_and_closing_ends_the_read(service: Service,
                                                                         terminals: list[FakeTerminal]) -> None:
    with Sandbox.create(ttl_seconds=60, service=service) as sbx:
        term = sbx.terminal(["prog"])
        seen: list[bytes] = []
        ended: list[BaseException | None] = []
        got_typed = threading.Event()

        def read() -> None:
            try:
                for chunk in term:
                    seen.append(chunk)
                    if b"typed 49" in b"".join(seen):
                        got_typed.set()
                ended.append(None)
            except BaseException as exc:  # the close from the other thread
                ended.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        for n in range(50):
            term.write(f"typed {n}\n")
        assert got_typed.wait(30), b"".join(seen)
        term.close()  # the reader is blocked in a read: it ends too
        reader.join(30)
        assert not reader.is_alive() and ended and (ended[0] is None or isinstance(ended[0], SandboxError)), ended
        assert terminals[0].ended_from_host.wait(30)
