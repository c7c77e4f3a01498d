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


def test_the_agent_serves_exactly_the_operations_the_wire_protocol_names(G):
    """guestwire.OPS is what templates record and the host requires: the agent must agree with it, and
    say so in `ping` (what the bake records in the manifest)."""
    assert set(G.OPS) == P.OPS
    assert G.op_ping(G.Request(FakeChannel(), 1, {"op": "ping"}))["ops"] == sorted(P.OPS)
    channel = FakeChannel()
    G.handle(G.Request(channel, 2, {"op": "no-such-op"}))
    assert channel.frames == [(P.MSG, 2, repr({"ok": False, "error": P.unknown_op("no-such-op")}).encode())]


def test_the_checkout_mounts_are_found_overlays_first_and_nothing_else(G):
    root = G.CHECKOUT_ROOT
    mounts = [
        "/dev/vda / ext4 rw,noatime 0 0",
        f"/dev/sr0 {root}/medium ext4 ro,nosuid,nodev,relatime 0 0",
        f"overlay /workspace/my\\040project overlay rw,relatime,lowerdir={root}/medium/tree:/workspace/my\\040project,"
        f"upperdir={root}/upper,workdir={root}/work,redirect_dir=on 0 0",
        "overlay /var/lib/docker/overlay2/abc/merged overlay rw,lowerdir=/var/lib/docker/overlay2/l/X,"
        "upperdir=/var/lib/docker/overlay2/abc/diff,workdir=/var/lib/docker/overlay2/abc/work 0 0",
        f"overlay /elsewhere overlay rw,upperdir={root}/upper-not-ours,workdir=/w 0 0",
    ]
    assert G.checkout_mounts(line + "\n" for line in mounts) == ["/workspace/my project", f"{root}/medium"]


def test_quiesce_is_refused_while_a_command_runs_and_no_command_starts_while_it_runs(G, monkeypatch, tmp_path):
    monkeypatch.setattr(G, "CGROUP_ROOT", str(tmp_path))
    unmounted: list[str] = []
    monkeypatch.setattr(G, "_unmount_checkout", lambda: unmounted.append("x") or 1)
    running = G.Exec(G.Request(FakeChannel(), 7, {"op": "exec"}))
    monkeypatch.setitem(G.EXECS, 7, running)
    reply = G.op_quiesce(G.Request(FakeChannel(), 8, {"op": P.QUIESCE, "timeout": 5}))
    assert reply["ok"] is False and reply["refused"] == P.EXEC_RUNNING and unmounted == []
    assert not G.QUIESCING.is_set()
    del G.EXECS[7]

    def flush() -> None:  # while the page cache is written, a command is refused
        started = G.op_exec(G.Request(FakeChannel(), 9, {"op": "exec", "argv": ["true"]}))
        assert started == {"ok": False, "error": "the guest is being quiesced for a snapshot: no command may start now"}
        assert not (tmp_path / "9").exists()

    monkeypatch.setattr(G, "_flush_page_cache", flush)
    reply = G.op_quiesce(G.Request(FakeChannel(), 10, {"op": P.QUIESCE, "timeout": 5}))
    assert reply["ok"] is True and reply["unmounted"] == 1 and reply["sync_ms"] >= 0, reply
    assert unmounted == ["x"] and not G.QUIESCING.is_set()


def test_quiesce_refuses_a_held_checkout_and_a_sync_past_its_timeout(G, monkeypatch):
    import errno

    def busy() -> int:
        raise OSError(errno.EBUSY, "umount /workspace: Device or resource busy")

    monkeypatch.setattr(G, "_unmount_checkout", busy)
    reply = G.op_quiesce(G.Request(FakeChannel(), 1, {"op": P.QUIESCE, "timeout": 5}))
    assert reply["ok"] is False and reply["refused"] == P.CHECKOUT_BUSY and "still uses the checkout" in reply["error"]
    release = threading.Event()
    monkeypatch.setattr(G, "_unmount_checkout", lambda: 0)
    monkeypatch.setattr(G, "_flush_page_cache", lambda: release.wait(30))
    try:
        reply = G.op_quiesce(G.Request(FakeChannel(), 2, {"op": P.QUIESCE, "timeout": 0.05}))
    finally:
        release.set()
    assert reply["ok"] is False and reply["refused"] == P.SYNC_TIMED_OUT, reply
    assert not G.QUIESCING.is_set()
