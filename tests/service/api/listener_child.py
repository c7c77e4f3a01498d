"""One listener (the GitHub webhook or the job API) in a process of its own, for the load tests.

Its open-file limit can be set (`--nofile`, as `ulimit -n` would) and most of its free fds taken
(`--leave-free`), so a flood meets EMFILE. Prints one JSON line saying where it listens and with
which caps, then serves until the end of stdin. The test reads its fds, threads and CPU time from
/proc: the child itself may have no fd left to do so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "service")]

SECRET = b"listener-child-webhook-secret"
TOKEN = "listener-child-token-0123456789"


class NoHooks:
    """The webhook's job hooks; the load tests deliver pings, which call none."""

    def prewarm(self, job: object) -> None:
        pass

    def job_completed(self, job: object) -> None:
        pass


def start_webhook(max_body: int | None = None) -> tuple[dict, object]:
    from runner.github.webhooks import DEFAULT_MAX_BODY, WebhookConfig, WebhookReceiver, WebhookServer

    config = WebhookConfig(secret=SECRET, labels=("microvm",), max_body=max_body or DEFAULT_MAX_BODY)
    server = WebhookServer(WebhookReceiver(config, NoHooks()))
    server.start()
    limits = server.httpd.limits
    return {"port": server.port, "max_connections": limits.max_connections, "max_workers": limits.max_workers,
            "max_body": config.max_body}, server.close


def start_api(state: Path) -> tuple[dict, object]:
    from runner.sandbox.fake import FakeSandboxes
    from runner.service.api.listeners import TcpApiServer
    from runner.service.config.reading import config_from_mapping
    from runner.service.host.assembly import ServiceHost

    config = config_from_mapping({"socket": str(state / "api.sock"), "state_dir": str(state / "state"),
                                  "listen": "127.0.0.1:0", "token": TOKEN, "shutdown_grace_seconds": 0})
    host = ServiceHost(config, sandboxes=FakeSandboxes().create).__enter__()
    tcp = next(s for s in host.api.servers if isinstance(s, TcpApiServer))
    return {"port": host.api.tcp_address[1], "socket": config.socket, "max_connections": tcp.limits.max_connections,
            "max_workers": tcp.limits.max_workers}, host.close


def take_fds(leave_free: int) -> list[int]:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(soft - len(os.listdir("/proc/self/fd")) - leave_free)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["webhook", "api"])
    parser.add_argument("--nofile", type=int)
    parser.add_argument("--leave-free", type=int)
    parser.add_argument("--max-body", type=int)
    args = parser.parse_args()
    if args.nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))
    with tempfile.TemporaryDirectory(prefix="mvc-load-", dir="/tmp") as state:
        where, stop = start_webhook(args.max_body) if args.kind == "webhook" else start_api(Path(state))
        hog = take_fds(args.leave_free) if args.leave_free is not None else []
        print(json.dumps(where), flush=True)
        sys.stdin.read()
        for fd in hog:
            os.close(fd)
        stop()


if __name__ == "__main__":
    main()
