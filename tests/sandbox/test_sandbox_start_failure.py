"""A sandbox whose VM does not start is the host's trouble, not a bug: the create is answered 503 with
Retry-After and the reason (it was a 500 'internal error', seen when a review-bot run met a busy host), the
sandbox's record says why, and its place in the quotas is given back."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

from runner.sandbox.fake import FakeSandboxes
from runner.service.host.assembly import ServiceHost


def _create(path: Path) -> tuple[int, dict[str, str], dict]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(path))
        sock.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_a_sandbox_whose_vm_does_not_start_is_503_with_its_reason_and_frees_its_place(
        hosts: Callable[..., ServiceHost], engine: FakeSandboxes) -> None:
    host = hosts(sandboxes={"max_live": 1, "max_per_caller": 1})
    engine.fail_create = True
    status, headers, body = _create(host.config.socket)
    assert status == 503, body
    assert headers.get("Retry-After") == "5"
    assert "the sandbox's VM did not start: the template could not be restored" in body["error"]
    assert host.service is not None
    failed = [r for r in host.service.records.list() if r.job_name == "sandbox"]
    assert [r.state.value for r in failed] == ["failed"] and "did not start" in (failed[0].error or "")
    engine.fail_create = False
    status, _, body = _create(host.config.socket)  # max_live 1: only if the failed one gave its place back
    assert status == 201, body
