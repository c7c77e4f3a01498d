"""The guest agent's own code, run on the host with a fake channel (no VM needed).

The agent is loaded the way the guest has it: installed by the rootfs builder into a directory of
its own, next to the wire protocol it imports by its installed name.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import ModuleType

import pytest

from runner.vm import guestwire as P
from vmimages.rootfs import install_agent


@pytest.fixture(scope="module")
def agent_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("guest") / "opt" / "microvm-check"
    install_agent(path)
    return path


@pytest.fixture(scope="module")
def G(agent_dir: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("installed_guest_agent", agent_dir / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_installed_agent_needs_nothing_but_the_standard_library(agent_dir: Path):
    """The guest's python3 has no project and no site-packages: -I -S gives the host the same."""
    assert sorted(p.name for p in agent_dir.iterdir()) == ["agent.py", "guestwire.py"]
    probe = "import sys; sys.path.insert(0, sys.argv[1]); import agent; print(agent.P.PORT_NAME)"
    done = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", probe, str(agent_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == P.PORT_NAME


class FakeChannel:
    def __init__(self) -> None:
        self.frames: list[tuple[int, int, bytes]] = []
        self.sent = threading.Event()

    def send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        self.frames.append((kind, rid, bytes(payload)))
        self.sent.set()

    def reply(self, rid: int, message: dict) -> None:
        self.frames.append((P.MSG, rid, repr(message).encode()))


def test_read_file_never_sends_more_than_the_limit_when_the_file_grows(G, tmp_path):
    """A FIFO stats as 0 bytes and then yields more: like a file growing between stat and read."""
    fifo = tmp_path / "growing"
    os.mkfifo(fifo)
    limit = P.MAX_CHUNK + 1000

    def writer() -> None:
        try:
            with open(fifo, "wb") as f:
                for _ in range(4):
                    f.write(b"x" * P.MAX_CHUNK)
        except BrokenPipeError:
            pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    channel = FakeChannel()
    req = G.Request(channel, 5, {"op": "read_file", "path": str(fifo), "max_bytes": limit})
    reply = G.op_read_file(req)
    t.join(timeout=5)
    sent = sum(len(p) for kind, _, p in channel.frames if kind == P.DATA)
    assert sent == limit and reply == {"ok": True, "size": limit}
    assert channel.frames[-1][0] == P.END


def test_output_of_a_daemon_after_the_reply_is_drained_not_sent(G, monkeypatch):
    """`server &` keeps the exec's pipes open: after the reply its output must not reach the host,
    which counts frames for finished requests as abuse."""
    channel = FakeChannel()
    read_fd, write_fd = os.pipe()
    pumps: list[threading.Thread] = []

    def fake_exec(req: G.Request) -> dict:
        pump = threading.Thread(target=G._pump, args=(os.fdopen(read_fd, "rb"), P.STDOUT, req), daemon=True)
        pump.start()
        pumps.append(pump)
        os.write(write_fd, b"before")
        assert channel.sent.wait(5)
        return {"ok": True}

    monkeypatch.setitem(G.OPS, "exec", fake_exec)
    G.handle(G.Request(channel, 3, {"op": "exec"}))
    for _ in range(100):  # more than a pipe holds: the pump must keep reading
        os.write(write_fd, b"after" * 1000)
    os.close(write_fd)
    pumps[0].join(timeout=5)
    assert not pumps[0].is_alive()
    assert [(kind, payload) for kind, _, payload in channel.frames if kind != P.MSG] == [(P.STDOUT, b"before")]
    assert channel.frames[-1][0] == P.MSG
