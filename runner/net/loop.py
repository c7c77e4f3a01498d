"""One thread that waits on every slot's DNS and audit sockets.

A thread per slot would cost thousands of threads at pool sizes the uplink allows; one selector
serves them all. Callbacks must not block: slow work (upstream DNS) goes to `NetLoop.submit`.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

log = logging.getLogger(__name__)

Callback = Callable[[socket.socket], None]


class NetLoop:
    """A selector thread plus a small worker pool for blocking follow-up work."""

    def __init__(self, workers: int = 16) -> None:  # more than dns.MAX_IN_FLIGHT: see there
        self.workers = workers
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[Callable[[], None]] = []
        self._workers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mvc-net")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="mvc-netloop", daemon=True)
        self._thread.start()

    def add_reader(self, sock: socket.socket, callback: Callback) -> None:
        sock.setblocking(False)
        self._call(lambda: self._selector.register(sock, selectors.EVENT_READ, callback))

    def remove_reader(self, sock: socket.socket) -> None:
        """Stop watching `sock` and close it, from the loop thread (so no callback runs afterwards)."""
        done = threading.Event()

        def remove() -> None:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
            done.set()

        self._call(remove)
        if threading.current_thread() is not self._thread:
            done.wait()

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self._workers.submit(fn)

    def close(self) -> None:
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join()
        self._workers.shutdown(wait=True)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_w.close()

    def _call(self, fn: Callable[[], None]) -> None:
        if threading.current_thread() is self._thread:
            fn()
            return
        with self._lock:
            self._pending.append(fn)
        self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=1.0):
                if key.data is None:
                    self._drain_wakeups()
                    continue
                try:
                    key.data(key.fileobj)
                except Exception:  # one bad packet or slot must not stop the others
                    log.exception("network callback failed")

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            pending, self._pending = self._pending, []
        for fn in pending:
            fn()
