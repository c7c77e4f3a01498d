"""The job API's listeners: a Unix socket (group-restricted) and, when configured, TCP with a token.

Served by `runner.httpserve` (h11 parses and frames the HTTP/1.1): heads are read by one selector
thread under overall deadlines, the TCP token is checked right after the headers (before any body is
read or a worker is taken: runner/service/api/gates.py), and at most MAX_WORKERS requests are served at
once, each by runner/service/api/handler.py's Handler.
"""

from __future__ import annotations

import grp
import json
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from runner.errors import ConfigError
from runner.httpserve import BoundedHTTPServer, ServerLimits, listen_tcp
from runner.jobapi.contract import MAX_JSON_BODY
from runner.service.api.exchange import Listener
from runner.service.api.gates import caller_gate, token_gate, urgent_on
from runner.service.api.handler import Handler
from runner.service.api.metrics import JobMetrics
from runner.service.api.paths import TCP, UNIX

if TYPE_CHECKING:
    from runner.service.github.desk import RunnerDesk
    from runner.service.jobs.sandboxes import SandboxDesk
    from runner.service.jobs.service import JobService

# Checkouts are large: after 30 s of grace a body must keep up 64 KiB/s on average. JSON bodies are read
# by the connection loop (a slow one holds no worker); 8 workers are kept for the fleet's hooks, so a job
# can always be reported and refused or admitted. `limits_for` adds connections for a large queue.
# One peer (a uid on the socket) has at most PEER_BODY_BYTES of JSON bodies in hand (read, or being parsed,
# until their answers begin): a parse holds the interpreter lock, and 64 bodies of 1 MiB parsed at once held
# health and every other caller for seconds (issue 40, item 9). Its further large bodies wait their turn,
# unread; bodies up to PEER_SMALL_BODY (a spec, a hook, an exec) never wait behind them, so a uid's own large
# or slow bodies do not hold back its small requests. How many bodies it sends at once is bounded by its
# connections (max_per_peer): a slow one costs an fd, and gives way to a waiting body once it lags.
PEER_BODY_BYTES, PEER_SMALL_BODY = 2 * MAX_JSON_BODY, 16 * 1024
LIMITS = ServerLimits(max_connections=512, max_workers=64, body_seconds=30.0, body_min_rate=64 * 1024,
                buffer_body_max=MAX_JSON_BODY, reserved_workers=8, max_per_peer=256,
                max_body_bytes_per_peer=PEER_BODY_BYTES, small_body_max=PEER_SMALL_BODY)


def limits_for(service: JobService, limits: ServerLimits = LIMITS) -> ServerLimits:
    """Connections for every queued and running job's client (its log stream and one request) on top of
    the listener's own: waiting clients cost an fd each, never a worker."""
    config = service.config
    wanted = 2 * (config.max_queued_jobs + config.max_concurrent_jobs) + 128
    return replace(limits, max_connections=max(limits.max_connections, wanted),
                   max_waiting=max(limits.max_waiting, wanted))


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode() + b"\n"


class UnixApiServer(Listener):
    kind = UNIX

    def __init__(self, path: str, service: JobService, group: str | None = None, limits: ServerLimits = LIMITS) -> None:
        self.service, self.path = service, path
        _prepare_socket_path(Path(path))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)  # created 0660 from the start: no window where others could connect
        try:
            listener.bind(path)
        except OSError:
            listener.close()
            raise
        finally:
            os.umask(old)
        listener.listen(1024)
        os.chmod(path, 0o660)
        if group:
            try:
                os.chown(path, -1, grp.getgrnam(group).gr_gid)
            except KeyError:
                listener.close()
                os.unlink(path)
                raise ConfigError(f"socket_group: no group named {group!r} on this host (create it or fix the config)") from None
        super().__init__(listener, Handler, limits, name="api-unix", error_body=_error_body,
                         gate=caller_gate(service, tcp=False, sandboxes=lambda: self.sandboxes), urgent=urgent_on(UNIX))

    def close(self) -> None:
        super().close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class TcpApiServer(Listener):
    kind = TCP

    def __init__(self, address: tuple[str, int], service: JobService, token: str, limits: ServerLimits = LIMITS,
                 metrics: JobMetrics | None = None) -> None:
        self.service, self.token = service, token  # the token also keys the page's CSRF tokens (web.csrf_token)
        self.metrics = metrics or JobMetrics()  # its own registry: several services in one process never collide
        super().__init__(listen_tcp(*address), Handler, limits, name="api-tcp", error_body=_error_body,
                         gate=token_gate(token, caller_gate(service, tcp=True, sandboxes=lambda: self.sandboxes)),
                         urgent=urgent_on(TCP))


def _prepare_socket_path(path: Path) -> None:
    """Create the socket's directory; remove a stale socket, but never one a live service answers on."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"socket: {path} exists and is not a socket; move it away or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: a previous service died without cleaning up
        return
    finally:
        probe.close()
    raise ConfigError(f"socket: another service already listens on {path}")


class ApiServers:
    """The Unix server and the optional TCP server, each with its own connection loop and workers."""

    def __init__(self, service: JobService, desk: RunnerDesk | None = None, limits: ServerLimits = LIMITS,
                 metrics: JobMetrics | None = None, host_status: Callable[[], dict[str, object]] | None = None,
                 sandboxes: SandboxDesk | None = None) -> None:
        """`desk` takes the runners' job hooks; `host_status` answers GET /v1/status (the host's VMs, spare
        pools, queue, recent jobs, runners); `sandboxes` serves /v1/sandboxes (none: those routes answer 404)."""
        config = service.config
        limits = limits_for(service, limits)
        unix = UnixApiServer(config.socket, service, config.socket_group, limits)
        self.servers: list[BoundedHTTPServer] = [unix]
        if host_status is not None:
            unix.host_status = host_status
        unix.metrics, unix.desk = metrics, desk
        unix.sandboxes = sandboxes
        if config.listen:
            assert config.token  # the config refuses a listen address without one
            try:
                tcp = TcpApiServer(config.listen, service, config.token, limits, metrics)
            except BaseException:  # e.g. the port is taken: leave no bound Unix socket behind
                self.close()
                raise
            if host_status is not None:
                tcp.host_status = host_status
            tcp.sandboxes, tcp.desk = sandboxes, desk
            self.servers.append(tcp)

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        for server in self.servers:
            if isinstance(server, TcpApiServer):
                host, port = server.address[:2]  # a TCP socket's name: (host, port[, flowinfo, scope_id])
                return str(host), int(port)
        return None

    def start(self) -> None:
        for server in self.servers:
            server.start()

    def close(self) -> None:
        for server in self.servers:
            server.close()
