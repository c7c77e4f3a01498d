"""The job API over a real Unix socket (and TCP with a token): status codes, streaming, auth."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import socket
import stat
import tarfile
import threading
from collections.abc import Callable

import pytest

from runner import httpserve
from runner.errors import ConfigError
from runner.jobapi.client import JobAPIError, JobClient
from runner.sandbox.fake import FakeSandboxes, floods, prints, waits
from runner.service.api.listeners import UnixApiServer
from tests.conftest import require
from tests.service.service_fakes import checkout_tar, member, spec, tar_of

TOKEN = "a-long-enough-test-token-1234"


def status_of(call: Callable[[], object]) -> int | None:
    with pytest.raises(JobAPIError) as err:
        call()
    return err.value.status


def raw(path: str, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def test_socket_is_group_only(api) -> None:
    service, client = api()
    mode = os.stat(service.config.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660
    assert client.health().ok is True


def test_full_job_over_the_socket(api, engine: FakeSandboxes) -> None:
    engine.programs["make"] = prints(b"building\n", 2)
    engine.artifacts_tar = tar_of([(member("out/report.xml"), b"<testsuite/>")])
    service, client = api()
    job = client.submit(spec("make", artifacts=["out/*.xml"]))
    assert job.state == "awaiting_checkout"
    assert client.upload_checkout(job.id, io.BytesIO(checkout_tar())).state == "queued"
    entries = list(client.logs(job.id))
    assert b"building\n" in [e.data for e in entries if e.stream == "stdout"]
    assert [e.seq for e in entries] == list(range(1, len(entries) + 1))
    rec = client.get(job.id)
    assert (rec.state, rec.exit_code, [a.to_wire() for a in rec.artifacts]) == ("finished", 2,
                                                                      [{"path": "out/report.xml", "size": 12}])
    out = io.BytesIO()
    assert client.artifacts(job.id, out) == len(out.getvalue()) > 0
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert tar.extractfile("out/report.xml").read() == b"<testsuite/>"
    assert [r.id for r in client.list(limit=5)] == [job.id]
    later = list(client.logs(job.id, after=entries[-2].seq))
    assert later == entries[-1:]


def test_chunked_checkout_upload(api, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    service, client = api()
    job = client.submit(spec("ok"))
    data = checkout_tar({"a": b"x" * 300000})
    client.upload_checkout(job.id, (data[i:i + 7000] for i in range(0, len(data), 7000)))
    list(client.logs(job.id))
    assert engine.created[0].files["/workspace/a"] == b"x" * 300000


def test_error_statuses(api, engine: FakeSandboxes) -> None:
    release = threading.Event()
    engine.programs["block"] = waits(release)
    service, client = api(max_queued_jobs=2, max_concurrent_jobs=1, checkout_max_bytes="64KiB")
    assert status_of(lambda: client.submit({"repository": "x"})) == 400
    assert status_of(lambda: client.get("j0123456789abcdef")) == 404
    assert status_of(lambda: client.get("no-such-job")) == 404
    assert status_of(lambda: client.cancel("j0123456789abcdef")) == 404
    job = client.submit(spec("block", timeout_seconds=600)).id
    assert status_of(lambda: client.artifacts(job, io.BytesIO())) == 409
    assert status_of(lambda: client.upload_checkout(job, b"\0" * 100000)) == 413
    assert status_of(lambda: client.upload_checkout(job, b"garbage" * 2000)) == 400
    client.upload_checkout(job, checkout_tar())
    assert status_of(lambda: client.upload_checkout(job, checkout_tar())) == 409
    client.submit(spec("block"))
    client.submit(spec("block"))
    with pytest.raises(JobAPIError) as full:
        for _ in range(3):
            client.submit(spec("block"))
    assert full.value.status == 429 and full.value.retry_after == 5
    assert client.cancel(job).state == "cancelled"
    assert status_of(lambda: client.artifacts(job, io.BytesIO())) == 404
    release.set()


def test_protocol_errors(api) -> None:
    service, _ = api()
    path = service.config.socket
    assert raw(path, b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 404")
    assert raw(path, b"DELETE /v1/jobs HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 501")
    assert raw(path, b"PUT /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").startswith(b"HTTP/1.1 404")
    bad_json = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\n{nope"
    answer = raw(path, bad_json)
    assert answer.startswith(b"HTTP/1.1 400") and b"not valid JSON" in answer
    job = JobClient(socket=path).submit(spec()).id
    bad_chunk = (f"PUT /v1/jobs/{job}/checkout HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                 "zz\r\nabc\r\n0\r\n\r\n").encode()
    assert raw(path, bad_chunk).startswith(b"HTTP/1.1 400")
    bad_query = f"GET /v1/jobs/{job}/logs?after=-1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    assert raw(path, bad_query).startswith(b"HTTP/1.1 400")
    huge = b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n" + b" " * 2000000
    assert raw(path, huge).startswith(b"HTTP/1.1 413")
    superscript = "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: \u00b2\r\nConnection: close\r\n\r\n"
    assert raw(path, superscript.encode("latin-1")).startswith(b"HTTP/1.1 400")  # a digit to str.isdigit()
    odd_query = f"GET /v1/jobs/{job}/logs?after=\u00b2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert raw(path, odd_query.encode()).startswith(b"HTTP/1.1 400")


def test_tcp_needs_the_token(hosts) -> None:
    host, port = hosts(listen="127.0.0.1:0", token=TOKEN).api.tcp_address
    url = f"http://{host}:{port}"
    assert status_of(lambda: JobClient(url=url).health()) == 401
    assert status_of(lambda: JobClient(url=url, token=TOKEN + "x").health()) == 401
    assert JobClient(url=url, token=TOKEN).health().ok is True


def test_tcp_client_sees_413_for_an_oversized_checkout(hosts) -> None:
    host, port = hosts(listen="127.0.0.1:0", token=TOKEN, checkout_max_bytes="1MiB").api.tcp_address
    client = JobClient(url=f"http://{host}:{port}", token=TOKEN)
    job = client.submit(spec()).id
    big = (b"\0" * 65536 for _ in range(320))  # 20 MiB, chunked
    assert status_of(lambda: client.upload_checkout(job, big)) == 413


def test_stale_socket_is_replaced_and_a_live_one_is_not(api, make_config) -> None:
    service, client = api()
    with pytest.raises(ConfigError, match="^socket: another service already listens on "):
        UnixApiServer(service.config.socket, service)
    client.health()
    path = service.config.socket + ".stale"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    server = UnixApiServer(path, service)
    server.close()
    assert not os.path.exists(path)


def test_unreachable_service_is_a_clear_error(short_dir) -> None:
    client = JobClient(socket=str(short_dir / "nobody.sock"))
    with pytest.raises(JobAPIError, match="cannot reach the job service") as err:
        client.health()
    assert err.value.status is None


def test_client_refuses_ambiguous_targets() -> None:
    with pytest.raises(ValueError, match="at most one of socket or url"):
        JobClient(socket="/x", url="http://y")
    with pytest.raises(ValueError, match="expected http\\(s\\)://HOST:PORT, got 'ftp://y'"):
        JobClient(url="ftp://y")


def test_log_end_line_carries_the_record(api, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"hi\n")
    service, client = api()
    job = client.submit(spec("ok")).id
    client.upload_checkout(job, checkout_tar())
    list(client.logs(job))
    answer = raw(service.config.socket, f"GET /v1/jobs/{job}/logs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert b"Transfer-Encoding: chunked" in answer
    lines = [line for line in answer.split(b"\r\n") if line.startswith(b"{")]
    end = json.loads(lines[-1])
    assert end["end"] is True and end["job"]["id"] == job and end["job"]["state"] == "finished"


def test_a_burst_of_clients_is_served(api) -> None:
    service, client = api()
    answers: list[bool] = []
    errors: list[Exception] = []

    def ask() -> None:
        try:
            answers.append(client.health().ok)
        except JobAPIError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(48)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and answers == [True] * 48


def test_a_client_that_never_reads_its_logs_does_not_hold_up_the_job(api, engine: FakeSandboxes) -> None:
    engine.programs["flood"] = floods(4 * 1024 * 1024)
    service, client = api(logs={"max_bytes": "8MiB"})  # within the budget: the job ends on its own
    job = client.submit(spec("flood")).id
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.connect(service.config.socket)
        stalled.sendall(f"GET /v1/jobs/{job}/logs HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        client.upload_checkout(job, checkout_tar())
        for _ in service.log_of(job).follow():  # the job's own log ends once the job has ended
            pass
        assert client.get(job).state == "finished"


def test_socket_group(make_service) -> None:
    import grp

    group = _spare_group()
    require(group is not None, "no group other than the effective one that this user may chown to")
    assert grp.getgrnam(group).gr_gid != os.getegid()  # else the socket would have it without the chown
    service = make_service(socket_group=group)
    server = UnixApiServer(service.config.socket, service, group)
    try:
        assert os.stat(service.config.socket).st_gid == grp.getgrnam(group).gr_gid
    finally:
        server.close()
    with pytest.raises(ConfigError, match="^socket_group: no group named 'no-such-group-mvc' on this host"):
        UnixApiServer(service.config.socket, service, "no-such-group-mvc")
    assert not os.path.exists(service.config.socket)


def _spare_group() -> str | None:
    """A named group, not the effective one, that this process may give a file: any for root."""
    import grp

    egid = os.getegid()
    gids = [g.gr_gid for g in grp.getgrall()] if os.geteuid() == 0 else os.getgroups()
    for gid in sorted(set(gids) - {egid}):
        try:
            return grp.getgrgid(gid).gr_name
        except KeyError:
            continue
    return None


def read_until_closed(sock: socket.socket, seconds: float = 10) -> tuple[bytes, bool]:
    """Everything the server sends, and whether it closed the connection within `seconds`."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return data, False
    return data, True


def test_idle_and_unauthenticated_connections_do_not_lock_out_a_client_with_the_token(hosts) -> None:
    served = hosts(listen="127.0.0.1:0", token=TOKEN)
    host, port = served.api.tcp_address
    with contextlib.ExitStack() as stack:
        for _ in range(64):
            stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)).connect(served.config.socket)
        for _ in range(70):
            sock = stack.enter_context(socket.create_connection((host, port), timeout=10))
            sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n")  # no token, and the head never ends
        assert JobClient(url=f"http://{host}:{port}", token=TOKEN, timeout=10).health().ok is True
        assert JobClient(socket=served.config.socket, timeout=10).health().ok is True


def test_the_token_is_checked_before_the_body_is_read(hosts) -> None:
    with socket.create_connection(hosts(listen="127.0.0.1:0", token=TOKEN).api.tcp_address, timeout=10) as sock:
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")  # and no body
        answer, closed = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 401") and b"WWW-Authenticate: Bearer" in answer and closed


HUGE = "1" * 4301  # one past Python's int() digit limit


@pytest.mark.parametrize("request_line, headers, status", [
    ("POST /v1/jobs", f"Content-Length: {HUGE}\r\n", b"413"),  # a length of many digits is a large body (issue 17)
    ("POST /v1/jobs", "Content-Length: 1000000000000000000000\r\n", b"413"),
    (f"GET /v1/jobs?limit={HUGE}", "", b"400"),
    (f"GET /v1/jobs/j0123456789abcdef/logs?after={HUGE}", "", b"400"),
], ids=["content-length", "content-length-10^21", "limit", "after"])
def test_numbers_of_4301_digits_are_refused_not_500(api, request_line: str, headers: str, status: bytes) -> None:
    service, _ = api()
    answer = raw(service.config.socket, f"{request_line} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 " + status) and b"error" in answer


@pytest.mark.parametrize("body, why", [
    (b"[" * 1000 + b"]" * 1000, b"nested deeper"),
    (json.dumps(spec("\ud800")).encode(), b"surrogate"),
    (json.dumps(spec("true", env={"A": "\ud800"})).encode(), b"surrogate"),
    (b'{"command": "\xff"}', b"not UTF-8"),
], ids=["nested-1000", "surrogate-command", "surrogate-env", "invalid-utf8"])
def test_hostile_json_is_400(api, body: bytes, why: bytes) -> None:
    service, _ = api()
    head = f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    answer = raw(service.config.socket, head.encode() + body)
    assert answer.startswith(b"HTTP/1.1 400") and why in answer


def test_a_client_gone_before_its_answer_leaves_no_traceback(api, caplog, capfd, monkeypatch) -> None:
    service, _ = api()
    caplog.set_level(logging.DEBUG, logger="runner")
    gone = threading.Event()
    respond = httpserve.ServedRequest.respond

    def after_the_client_went(self, status: int, body: bytes, headers) -> None:  # type: ignore[no-untyped-def]
        gone.wait(60)  # a fast worker wrote its 400 while the socket was still open: nothing went away (1 run in 4)
        respond(self, status, body, headers)

    monkeypatch.setattr(httpserve.ServedRequest, "respond", after_the_client_went)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(service.config.socket)
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope")
    gone.set()
    for _ in range(1200):  # the worker notices when it writes the 400; generous, for a loaded machine
        if any("went away" in r.getMessage() for r in caplog.records):
            break
        threading.Event().wait(0.05)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert [r.levelno for r in gone] == [logging.DEBUG]
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err


def test_a_body_sent_with_get_or_cancel_is_never_read_as_a_request(api) -> None:
    service, client = api()
    job = client.submit(spec()).id
    smuggled = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n\r\n"
    for line in (b"GET /v1/health", f"POST /v1/jobs/{job}/cancel".encode()):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(service.config.socket)
            sock.sendall(line + b" HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
            answer, closed = read_until_closed(sock)
        assert answer.count(b"HTTP/1.1 ") == 1 and closed, answer


def test_slow_heads_and_idle_keep_alive_connections_are_cut_off(api) -> None:
    """One byte a second never completes a head within its 10 s; a kept-alive connection idles 5 s at most."""
    service, _ = api()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
        idle.connect(service.config.socket)
        idle.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        slow.connect(service.config.socket)
        slow.setblocking(False)
        cut = False
        for byte in b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"y" * 40:  # 30 s at most
            try:
                slow.send(bytes([byte]))
                cut = slow.recv(65536) is not None  # data (a 408) or b"" (closed): either way, cut off
            except BlockingIOError:
                pass
            except OSError:
                cut = True
            if cut:
                break
            threading.Event().wait(1.0)
        assert cut
        answer, closed = read_until_closed(idle, 15)
        assert answer.startswith(b"HTTP/1.1 200") and closed
