"""The job API decides who is asking on the head, before a body is read (runner/service/api/gates.py,
`caller_gate`), and the fleet's hooks are urgent (they take the reserved workers).

A process of the runner user on a fleet host, without a runner token or with a forged one, declares a
small JSON body and never sends it: it is answered at once (403 / 401) and its connection closed. Were
the caller checked only after the body, the connection loop would wait for that body (a slow body
then holds the loop's budget, a large one a worker) and the answer would come only at the body's
deadline, seconds later.
"""

from __future__ import annotations

import json
import subprocess
from http.client import HTTPMessage

from runner.httpserve import Head
from runner.jobapi.contract import RUNNER_TOKEN_HEADER
from tests.fleet.conftest import PYTHON
from tests.fleet.test_fleet import wait_until

# Run as the runner user: one raw request per line of argv[2] (JSON [head, ...]), the status line of
# each answer (or "none" when nothing came within 5 s) printed.
RAW = r"""
import json, socket, sys
for head in json.loads(sys.argv[2]):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(sys.argv[1])
        sock.sendall(head.encode())
        try:
            data = sock.recv(65536)
        except TimeoutError:
            data = b""
        print(data.split(b"\r\n", 1)[0].decode() or "none")
"""


def head(path: str, token: str | None = None) -> str:
    extra = f"{RUNNER_TOKEN_HEADER}: {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
            f"{extra}\r\n")


def test_a_caller_that_would_be_refused_is_answered_before_its_body_arrives(make_rig) -> None:
    with make_rig(vms=False, min_idle=1, max_runners=1, shutdown_grace_seconds=0) as rig:
        wait_until(lambda: rig.fleet.runners(), 60, "a runner")
        heads = [head("/v1/jobs"), head("/v1/jobs", "a-token-the-service-never-issued"),
                 head("/v1/runner/job-started")]
        done = subprocess.run([str(PYTHON), "-I", "-c", RAW, str(rig.root / "api.sock"), json.dumps(heads)],
                              user=rig.account.uid, group=rig.account.group, extra_groups=[rig.account.group],
                              cwd="/", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["HTTP/1.1 403 Forbidden", "HTTP/1.1 401 Unauthorized",
                                           "HTTP/1.1 403 Forbidden"], done.stdout


def test_the_fleets_hooks_are_urgent_and_have_workers_kept_for_them(make_rig) -> None:
    with make_rig(vms=False, min_idle=0, max_runners=1, shutdown_grace_seconds=0) as rig:
        servers = rig.host.api.servers
    for server in servers:
        assert server.limits.reserved_workers >= 1
        for path in ("/v1/runner/job-started", "/v1/runner/job-completed"):
            assert server.urgent(Head("POST", path, HTTPMessage()))
        assert not server.urgent(Head("POST", "/v1/jobs", HTTPMessage()))
