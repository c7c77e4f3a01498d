"""What the job API fuzz (tests/fuzz/test_fuzz_job_api.py) found, each pinned with the input it found."""

from __future__ import annotations

import socket

import pytest

from runner.jobapi.client import JobAPIError
from runner.service.api import paths
from tests.service.service_fakes import checkout_tar, spec


def raw(path: str, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def test_a_refusal_to_head_has_no_body(api) -> None:
    """A body after the answer to HEAD is read by the client as its next answer (RFC 9110 9.3.2)."""
    service, _ = api()
    many = b"".join(b"X-Many: %d\r\n" % i for i in range(120))  # http.client's limit is 100: 431 from the selector
    answer = raw(service.config.socket, b"HEAD / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 431 ") and answer.endswith(b"\r\n\r\n") and answer.count(b"\r\n\r\n") == 1
    get = raw(service.config.socket, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert get.startswith(b"HTTP/1.1 431 ") and get.endswith(b"more than 100 headers\"}\n")


@pytest.mark.parametrize("path, route", [
    ("/v1/jobs/j0123456789abcdef", ("j0123456789abcdef", "")),
    ("/v1/jobs/j0123456789abcdef/logs", ("j0123456789abcdef", "/logs")),
    ("/v1/jobs/j0123456789abcdef\n", None),  # `$` matched before the newline: routed to job "j...\n"
    ("/v1/jobs/j0123456789abcdef/cancel\n", None),
    ("/v1/jobs/j0123456789abcdef/nothing", None),
])
def test_job_routes_match_the_whole_path(path: str, route: tuple[str, str] | None) -> None:
    assert paths.job_route(path) == route


def test_a_checkout_cut_inside_a_member_is_refused_at_upload(api) -> None:
    """check_tar seeks over file data, and a seek past the end of the spooled file succeeded silently: the
    upload was accepted (202) and the job then failed in the VM, with a traceback in the service's log."""
    service, client = api()
    job = client.submit(spec()).id
    cut = checkout_tar({"README": b"hello\n" * 200})[:700]  # the header and part of the member's data
    with pytest.raises(JobAPIError, match="ends inside a member's data") as err:
        client.upload_checkout(job, cut)
    assert err.value.status == 400
    assert client.upload_checkout(job, checkout_tar()).state == "queued"  # the job still takes a whole one
