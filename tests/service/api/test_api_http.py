"""The job API's HTTP/1.1 on the wire (h11 parses and frames it): chunked bodies, keep-alive, HTTP/1.0, Expect.

Raw requests over the real Unix socket, so what is checked is the bytes a client sees.
"""

from __future__ import annotations

import re
import socket

import pytest

from runner.jobapi.client import JobClient
from runner.sandbox.fake import FakeSandboxes, prints
from tests.service.service_fakes import checkout_tar, spec

STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) ")


def connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def exchange(path: str, request: bytes) -> bytes:
    with connect(path) as sock:
        sock.sendall(request)
        return read_until_closed(sock)


def statuses(answer: bytes) -> list[int]:
    return [int(code) for code in STATUS_LINE.findall(answer)]


def chunked(data: bytes, size: int = 3000) -> bytes:
    """`data` as chunks, one with a chunk extension, and a trailer field after the last chunk."""
    pieces = [data[i:i + size] for i in range(0, len(data), size)]
    body = b"".join(b"%x%s\r\n%s\r\n" % (len(p), b";ext=1" if i == 1 else b"", p) for i, p in enumerate(pieces))
    return body + b"0\r\nX-Trailer: done\r\n\r\n"


def test_a_chunked_checkout_keeps_the_connection_for_the_next_request(api) -> None:
    """Chunk extensions and trailers are read; a body read whole leaves the connection reusable (it was closed)."""
    service, client = api()
    job = client.submit(spec()).id
    put = (f"PUT /v1/jobs/{job}/checkout HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    health = b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    answer = exchange(service.config.socket, put + chunked(checkout_tar({"a": b"x" * 10000})) + health)
    assert statuses(answer) == [202, 200], answer[:500]
    assert client.get(job).state != "awaiting_checkout"  # the checkout was taken whole


@pytest.mark.parametrize("chunks, why", [
    (b"0x5\r\nhello\r\n0\r\n\r\n", b"illegal chunk header"),  # int(x, 16) takes "0x5"
    (b"5\r\nhelloXX0\r\n\r\n", b"malformed chunk footer"),
], ids=["0x-size", "no-crlf-after-data"])
def test_broken_chunk_framing_is_400_and_closes(api, chunks: bytes, why: bytes) -> None:
    service, client = api()
    job = client.submit(spec()).id
    head = f"PUT /v1/jobs/{job}/checkout HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    answer = exchange(service.config.socket, head + chunks + b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert statuses(answer) == [400] and b"Connection: close" in answer
    assert b'"error": "bad request: ' + why in answer
    assert client.get(job).state == "awaiting_checkout"


@pytest.mark.parametrize("headers, status, why", [
    (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400, b"either Content-Length or Transfer-Encoding"),
    (b"Transfer-Encoding: gzip\r\n", 501, b"only Transfer-Encoding: chunked is supported"),
    (b"Content-Length: 5\r\nContent-Length: 6\r\n", 400, b"malformed request: conflicting Content-Length headers"),
], ids=["both", "gzip", "two-lengths"])
def test_ambiguous_or_unknown_framing_is_refused_before_a_worker(api, headers: bytes, status: int, why: bytes) -> None:
    service, _ = api()
    answer = exchange(service.config.socket, b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n{}")
    assert statuses(answer) == [status] and why in answer and b"Connection: close" in answer


def test_an_http_1_0_client_gets_its_log_close_delimited(api, engine: FakeSandboxes) -> None:
    """HTTP/1.0 has no chunked coding (RFC 9112 7): the stream ends with the connection. It was sent chunked."""
    engine.programs["hi"] = prints(b"hello\n")
    service, client = api()
    job = client.submit(spec("hi")).id
    client.upload_checkout(job, checkout_tar())
    list(client.logs(job))
    answer = exchange(service.config.socket, f"GET /v1/jobs/{job}/logs HTTP/1.0\r\n\r\n".encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Transfer-Encoding" not in head and b"Connection: close" in head
    lines = body.splitlines()
    assert b'"end": true' in lines[-1] and any(b'"stream":"stdout"' in line for line in lines[:-1]), body[:500]


def test_an_answer_before_the_body_was_read_says_connection_close(api) -> None:
    """The unread rest of a body cannot be told from a next request: the answer says the connection ends."""
    service, _ = api()
    answer = exchange(service.config.socket, b"GET /v1/health HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n")
    assert statuses(answer) == [200] and b"\r\nConnection: close\r\n" in answer


def test_a_client_that_expects_100_continue_gets_it_before_sending_the_body(api) -> None:
    service, client = api()
    job = client.submit(spec()).id
    data = checkout_tar()
    with connect(service.config.socket) as sock:
        sock.sendall(f"PUT /v1/jobs/{job}/checkout HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                     "Expect: 100-continue\r\nConnection: close\r\n\r\n".encode())
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(data)
        answer = read_until_closed(sock)
    assert statuses(answer) == [202]


def test_head_is_answered_501_without_a_body(api) -> None:
    """A body after the answer to HEAD would be read as the next answer (RFC 9110 9.3.2)."""
    service, _ = api()
    answer = exchange(service.config.socket, b"HEAD /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert statuses(answer) == [501] and answer.endswith(b"\r\n\r\n") and answer.count(b"\r\n\r\n") == 1
    length = int(re.search(rb"Content-Length: (\d+)", answer).group(1))
    get = exchange(service.config.socket, b"FETCH /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert get.endswith(b"\"Unsupported method ('FETCH')\"}\n") and length == len(b"{\"error\": \"Unsupported method ('HEAD')\"}\n")


def test_pipelined_requests_are_answered_in_order_on_one_connection(api) -> None:
    service, client = api()
    job = client.submit(spec()).id
    many = (f"GET /v1/jobs/{job} HTTP/1.1\r\nHost: x\r\n\r\n".encode() + b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
            + b"GET /v1/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = exchange(service.config.socket, many)
    assert statuses(answer) == [200, 200, 404] and answer.count(job.encode()) >= 1
    assert JobClient(socket=service.config.socket).health().ok is True
