"""The guest agent's own code, run on the host with a fake channel (no VM needed)."""

from __future__ import annotations

import os
import threading

from vmimages.guest import agent as G
from vmimages.guest import protocol as P


class FakeChannel:
    def __init__(self) -> None:
        self.frames: list[tuple[int, int, bytes]] = []
        self.sent = threading.Event()

    def send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        self.frames.append((kind, rid, bytes(payload)))
        self.sent.set()

    def reply(self, rid: int, message: dict) -> None:
        self.frames.append((P.MSG, rid, repr(message).encode()))


def test_read_file_never_sends_more_than_the_limit_when_the_file_grows(tmp_path):
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

