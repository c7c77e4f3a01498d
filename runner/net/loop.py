"""One thread that waits on every slot's DNS and audit sockets, and runs their periodic chores.

A thread per slot would cost thousands of threads at pool sizes the uplink allows; one selector
serves them all, and `every` gives periodic work (closing expired resolver openings) the same
thread instead of a timer thread per item. Callbacks must not block: slow work (upstream DNS, a
firewall write) goes to `NetLoop.submit`.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)

Callback = Callable[[socket.socket], object]  # what it returns is ignored
MAX_WAIT = 1.0  # the selector's longest sleep: how soon a close() is noticed without a wake-up


class _Every:
    """A periodic callback and when it is next due (time.monotonic())."""

    def __init__(self, seconds: float, fn: Callable[[], None]) -> None:
        self.seconds = seconds
        self.fn = fn
        self.due = time.monotonic() + seconds


class NetLoop:
    """A selector thread plus a small worker pool for blocking follow-up work."""

    def __init__(self, workers: int = 16) -> None:  # more than dns.MAX_IN_FLIGHT: see there
        self.workers = workers
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pending: list[Callable[[], object]] = []
        self._periodic: list[_Every] = []
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

    def every(self, seconds: float, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread every `seconds` until the loop closes; like a reader's
        callback it must not block (hand slow work to `submit`)."""
        if seconds <= 0:
            raise ValueError(f"a periodic callback needs a positive interval, got {seconds}")
        self._call(lambda: self._periodic.append(_Every(seconds, fn)))

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        return self._workers.submit(fn)

    def close(self) -> None:
        self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join()
        self._workers.shutdown(wait=True)
        for key in list(self._selector.get_map().values()):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)  # add_reader and the wake-up pair register sockets only
            sock.close()
        self._selector.close()
        self._wake_w.close()

    def _call(self, fn: Callable[[], object]) -> None:
        if threading.current_thread() is self._thread:
            fn()
            return
        with self._lock:
            self._pending.append(fn)
        self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select(timeout=self._wait()):
                if key.data is None:
                    self._drain_wakeups()
                    continue
                try:
                    key.data(key.fileobj)
                except Exception:  # one bad packet or slot must not stop the others
                    log.exception("network callback failed")
            self._run_due()

    def _wait(self) -> float:
        """Seconds until the next periodic callback is due, at most `MAX_WAIT`."""
        now = time.monotonic()
        return max(0.0, min([MAX_WAIT, *(every.due - now for every in self._periodic)]))

    def _run_due(self) -> None:
        now = time.monotonic()
        for every in self._periodic:
            if every.due <= now:
                every.due = now + every.seconds
                try:
                    every.fn()
                except Exception:
                    log.exception("periodic network callback failed")

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
