"""Fuzz the job API through its real listeners: the Unix socket, and TCP with a bearer token.

The service runs on the fake VM engine (tests/service/service_fakes.py), as tests/service/api/test_api.py
builds it. Each input is one raw connection: a request (or two, pipelined) built from the API's routes
and then mutated where hostile clients mutate it: the request line, the headers and the body framing
(Content-Length, Transfer-Encoding, chunk sizes), the query strings (`?limit=`, `?after=`), submit
bodies seeded from valid JobSpecs (types swapped, huge integers, lone surrogates, NULs, nesting,
unknown and duplicate keys) and checkout uploads (valid tars, hostile tars, garbage). Routes that name
a job use the jobs the fuzz itself created, so cancels, logs, artifacts and checkouts reach real jobs.

For every input: each answer is well-formed HTTP, no 5xx but a 503 with Retry-After, no traceback in
the service's log and no thread dies. After the batch: every job the fuzz left is cancelled through
the API, a valid submit over TCP with the token is answered within a second, and the process is back
to the threads and file descriptors it had before the batch.
"""

from __future__ import annotations

import copy
import json
import shutil
import socket
import tarfile
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runner.jobapi.client import JobClient
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.api.listeners import ApiServers
from runner.service.config.reading import config_from_mapping
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.service import JobService
from tests.fuzz.fuzzing import INPUTS, fuzz
from tests.fuzz.wire import Answer, Tracebacks, Usage, assert_settled, check_answers, exchange, settle
from tests.service.service_fakes import SHA, checkout_tar, member, spec, tar_of

TOKEN = "fuzz-token-0123456789abcdef"
JOB = b"{JOB}"  # replaced by one of the fuzz's own jobs (or a literal id) when the input is sent

def rarely(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in `one_in` draws. Not `integers(0, n) == 0`: hypothesis favours the bounds, so that
    branch would be taken far more often than one in n and crowd out the well-formed inputs."""
    return draw(st.sampled_from([False] * (one_in - 1) + [True]))


# -- submit bodies ------------------------------------------------------------------------------

SEED_SPECS = [
    spec(),
    spec("make test", env={"CI": "true", "GITHUB_SHA": SHA}, artifacts=["out/*.xml", "log.txt"], timeout_seconds=60),
    spec("true", run_id=2202229078, run_attempt=1, runner_name="r1", ref="refs/pull/1/merge", event="pull_request",
         working_directory="src", template="base"),
    spec("true", policy="version: 1\nmode: block\nallow: []\n"),
]
SPEC_KEYS = ["repository", "sha", "command", "job_name", "runner_name", "ref", "event", "run_id", "run_attempt",
             "working_directory", "env", "artifacts", "timeout_seconds", "template", "policy"]
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, 1e308, -0.0,
    float("nan"), float("inf"), "", " ", "\x00", "a\x00b", "\ud800", "a\udc00b", "\U0001f600", "\u202e",
    "x" * 70000, "../../etc/passwd", "/abs", "a\nb", SHA + "\n", SHA.upper(), SHA[:39], "octo/..", "../x",
    "octo/hello\n", "base\n", [], [1], ["*"] * 65, ["../x"], ["\ud800"], {}, {"a": "b"}, {"CI": "\x00"},
    {"A" * 200: "x"}, {"GITHUB_TOKEN": "x"}, {"CI": "\ud800"}, {"CI": 1}, {str(i): "x" for i in range(130)},
    "version: 1\nmode: allow\n", "&a [*a]", "{" * 100,
]
VALUES = st.one_of(st.sampled_from(ODD_VALUES), st.integers(), st.text(max_size=20),
                   st.floats(allow_nan=True, allow_infinity=True), st.lists(st.text(max_size=5), max_size=3))


@st.composite
def submit_bodies(draw: st.DrawFn) -> bytes:
    data: dict[Any, Any] = copy.deepcopy(draw(st.sampled_from(SEED_SPECS)))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        action = draw(st.sampled_from(["swap", "swap", "swap", "delete", "unknown"]))
        if action == "swap":
            data[draw(st.sampled_from(SPEC_KEYS))] = draw(VALUES)
        elif action == "delete" and data:
            data.pop(draw(st.sampled_from(sorted(data))))
        else:
            data[draw(st.sampled_from(["x", "", "__proto__", "\ud800", "k" * 300, "Repository"]))] = draw(VALUES)
    text = json.dumps(data, ensure_ascii=draw(st.booleans()))  # NaN and Infinity too: not JSON, still sent
    body = text.encode("utf-8", "surrogatepass")  # a raw lone surrogate is invalid UTF-8 on the wire
    if rarely(draw, 4):
        body = draw(text_mutation(body))
    return body


@st.composite
def text_mutation(draw: st.DrawFn, body: bytes) -> bytes:
    """What a JSON encoder would never write: deep nesting, long digit runs, duplicates, stray bytes."""
    action = draw(st.sampled_from(["nest", "wrap", "digits", "duplicate", "byte", "truncate", "bom", "nul"]))
    depth = draw(st.sampled_from([63, 64, 65, 1000, 5000]))
    inner = body[:-1] if body.endswith(b"}") else body
    if action == "nest":
        return inner + b', "env": ' + b"[" * depth + b"]" * depth + b"}"
    if action == "wrap":
        return b"[" * depth + body + b"]" * depth
    if action == "digits":
        digits = b"9" * draw(st.sampled_from([19, 20, 400, 4301, 5000]))
        return inner + b', "run_id": ' + draw(st.sampled_from([digits, b"-" + digits, b"1e999999", b"0." + digits])) + b"}"
    if action == "duplicate":
        return inner + b', "command": ' + draw(st.sampled_from([b"1", b"null", b'"true"', b"[]"])) + b"}"
    at = draw(st.integers(0, len(body)))
    if action == "byte":
        return body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1:]
    if action == "truncate":
        return body[:at]
    if action == "bom":
        return b"\xef\xbb\xbf" + body
    return body[:at] + b"\x00" + body[at:]


# -- checkout bodies ----------------------------------------------------------------------------


def _hostile_tars() -> list[bytes]:
    link = member("escape", tarfile.SYMTYPE, "../../../etc")
    return [
        tar_of([(member("../outside"), b"x")]),
        tar_of([(member("/etc/abs"), b"x")]),
        tar_of([(link, None), (member("escape/passwd"), b"x")]),
        tar_of([(member("hard", tarfile.LNKTYPE, "/etc/passwd"), None)]),
        tar_of([(member("dev", tarfile.CHRTYPE), None)]),
        tar_of([(member(".git/config"), b"[core]\n")]),
        tar_of([(member("a" * 5000), b"x")]),
    ]


VALID_TARS = [checkout_tar(), checkout_tar({"src/main.c": b"int main(){}\n", "README": b"x" * 3000})]
CHECKOUTS = st.one_of(
    st.sampled_from(VALID_TARS), st.sampled_from(_hostile_tars()), st.binary(max_size=2048),
    st.tuples(st.sampled_from(VALID_TARS), st.integers(0, 2047)).map(lambda t: t[0][:t[1]]),
    st.tuples(st.sampled_from(VALID_TARS), st.integers(0, 1023), st.integers(0, 255)).map(
        lambda t: t[0][:t[1]] + bytes([t[2]]) + t[0][t[1] + 1:]),
    st.just(b"\x1f\x8b\x08\x00" + b"\0" * 600), st.just(b"\0" * 300 * 1024),  # gzip magic; past checkout_max_bytes
)

# -- requests -----------------------------------------------------------------------------------

LITERAL_IDS = [b"j0123456789abcdef", b"J0123456789ABCDEF", b"..", b"%2e%2e", b"j" + b"0" * 200, b"\xc3\xa9",
               b"j0123456789abcdef%0a", b"", b"%00", b"a;b", b"j" * 9000]
QUERY_VALUES = [b"", b"0", b"1", b"50", b"1000", b"1001", b"-1", b"+1", b" 1", b"1" * 19, b"1" * 4301, b"\xc2\xb2",
                b"%C2%B2", b"1e3", b"%31", b"a", b"4611686018427387904", b"4611686018427387903", b"0x10", b"%00"]


@dataclass
class Plan:
    method: bytes
    target: bytes
    body: bytes = b""
    headers: list[bytes] = field(default_factory=list)


@st.composite
def queries(draw: st.DrawFn, name: bytes) -> bytes:
    if rarely(draw, 4):
        return b""
    values = draw(st.lists(st.sampled_from(QUERY_VALUES) | st.binary(max_size=8).map(lambda b: b.hex().encode()),
                           min_size=1, max_size=2))
    return b"?" + b"&".join(name + b"=" + value for value in values)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    kind = draw(st.sampled_from(["submit"] * 5 + ["checkout"] * 4 + ["cancel", "cancel", "logs", "artifacts", "get",
                                                                      "list", "health", "unknown", "garbage"]))
    if kind == "submit":
        return Plan(b"POST", b"/v1/jobs", draw(submit_bodies()), [b"Content-Type: application/json"])
    if kind == "checkout":
        return Plan(b"PUT", b"/v1/jobs/" + JOB + b"/checkout", draw(CHECKOUTS), [b"Content-Type: application/x-tar"])
    if kind == "cancel":
        return Plan(b"POST", b"/v1/jobs/" + JOB + b"/cancel", draw(st.sampled_from([b"", b"{}", b"GET / HTTP/1.1\r\n\r\n"])))
    if kind == "logs":
        return Plan(b"GET", b"/v1/jobs/" + JOB + b"/logs" + draw(queries(b"after")))
    if kind == "artifacts":
        return Plan(b"GET", b"/v1/jobs/" + JOB + b"/artifacts")
    if kind == "get":
        return Plan(b"GET", b"/v1/jobs/" + JOB)
    if kind == "list":
        return Plan(b"GET", b"/v1/jobs" + draw(queries(b"limit")))
    if kind == "health":
        return Plan(b"GET", b"/v1/health")
    if kind == "unknown":
        method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"HEAD", b"OPTIONS", b"get"]))
        target = draw(st.sampled_from([b"/", b"/v1", b"/v1/jobs/", b"/v1/jobs//logs", b"/v1/jobs/" + JOB + b"/nothing",
                                       b"/v1/jobs/" + JOB + b"/logs/", b"/v1/jobs/" + JOB + b"/checkout/x",
                                       b"/v1/health/", b"/v2/jobs", b"*", b"http://x/v1/health",
                                       b"/v1/jobs/../v1/health", b"/v1/jobs/" + JOB + b"%0a"]))
        return Plan(method, target, draw(st.sampled_from([b"", b"{}"])))
    return Plan(b"", b"", draw(st.binary(max_size=200)))  # garbage: sent as it is


@st.composite
def framings(draw: st.DrawFn, body: bytes) -> tuple[list[bytes], bytes]:
    """Headers and bytes that carry `body`: mostly right, sometimes every way framing goes wrong."""
    how = draw(st.sampled_from(["length"] * 6 + ["chunked"] * 2 + ["wrong-length", "odd-length", "two-lengths",
                                                                     "length-and-chunked", "other-coding", "none"]))
    if how == "length":
        return ([b"Content-Length: %d" % len(body)] if body else []), body
    if how == "chunked":
        return [b"Transfer-Encoding: chunked"], draw(chunked(body))
    if how == "wrong-length":
        return [b"Content-Length: %d" % max(0, len(body) + draw(st.integers(-20, 20)))], body
    if how == "odd-length":
        value = draw(st.sampled_from([b"", b"-1", b"+5", b" 5 ", b"5, 5", b"0x10", b"\xc2\xb2", b"1" * 19,
                                      b"1" * 4301, b"1e3", b"99999999999999999"]))
        return [b"Content-Length: " + value], body
    if how == "two-lengths":
        return [b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) + draw(st.integers(0, 1)))], body
    if how == "length-and-chunked":
        return [b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked"], draw(chunked(body))
    if how == "other-coding":
        coding = draw(st.sampled_from([b"gzip", b"chunked, gzip", b"identity", b"Chunked", b"chunked\x0b", b""]))
        return [b"Transfer-Encoding: " + coding], body
    return [], body


@st.composite
def chunked(draw: st.DrawFn, body: bytes) -> bytes:
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if b > a]
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    if rarely(draw, 3):
        bad = draw(st.sampled_from([b"zz", b"0x10", b"-1", b"ffffffffffffffff", b"1" * 17, b"5;ext=1", b"5 ", b"",
                                    b"A" * 1100]))
        out = bad + b"\r\nhello\r\n" + out[draw(st.sampled_from([0, len(out) - 5])):]  # sometimes no last chunk
    return out


AUTH = [b"Authorization: Bearer " + TOKEN.encode()] * 8 + [
    b"", b"Authorization: Bearer " + TOKEN.encode() + b"x", b"Authorization: bearer " + TOKEN.encode(),
    b"Authorization: Basic " + TOKEN.encode(), b"Authorization: Bearer", b"Authorization: Bearer \xff\xfe",
]
HEADER_NOISE = [b"Connection: close", b"Connection: keep-alive", b"Expect: 100-continue", b"Host: x", b"Host: y",
                b"X-Long: " + b"y" * 70000, b"No-Colon", b" folded: continuation", b"X-Nul: a\x00b",
                b"X-Latin: \xe9", b"Content-Type: text/plain", b"Transfer-Encoding:"]


@dataclass(frozen=True)
class Input:
    tcp: bool
    data: bytes  # with JOB where a job id goes
    job: int | bytes  # an index into the fuzz's own jobs, or a literal id


@st.composite
def inputs(draw: st.DrawFn) -> Input:
    plan = draw(plans())
    if not plan.method:  # garbage
        data = plan.body
    else:
        framing, body = draw(framings(plan.body)) if plan.body else ([], b"")
        noise = draw(st.lists(st.sampled_from(HEADER_NOISE), max_size=2)) if rarely(draw, 5) else []
        if rarely(draw, 20):
            noise += [b"X-Many: %d" % i for i in range(120)]
        version = b"HTTP/1.1" if not rarely(draw, 10) else draw(st.sampled_from([b"HTTP/1.0", b"HTTP/2", b"http/1.1",
                                                                                   b"HTTP/1.1 x", b""]))
        method = plan.method if not rarely(draw, 15) else draw(st.sampled_from([b"G ET", b"GET\t", b"X" * 30,
                                                                                    plan.method.lower()]))
        line = method + b" " + plan.target + b" " + version
        data = b"\r\n".join([line, b"Host: localhost", *plan.headers, *framing, *noise]) + b"\r\n\r\n" + body
        if rarely(draw, 4):  # a second request on the same connection
            data += b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n"
    tcp = rarely(draw, 4)
    if tcp:
        auth = draw(st.sampled_from(AUTH))
        if auth and b"\r\n" in data:
            data = data.replace(b"\r\n", b"\r\n" + auth + b"\r\n", 1)
    job = draw(st.integers(0, 10**6) | st.sampled_from(LITERAL_IDS))
    return Input(tcp, data, job)


# -- the service --------------------------------------------------------------------------------


@dataclass
class Served:
    service: JobService
    servers: ApiServers
    jobs: list[str] = field(default_factory=list)

    def connect_unix(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.service.config.socket)
        return sock

    def connect_tcp(self) -> socket.socket:
        return socket.create_connection(self.servers.tcp_address)

    def job_id(self, job: int | bytes) -> bytes:
        if isinstance(job, int):
            return self.jobs[job % len(self.jobs)].encode() if self.jobs else b"j0123456789abcdef"
        return job


@pytest.fixture
def served() -> Iterator[Served]:
    directory = Path(tempfile.mkdtemp(prefix="mvc-fuzz-api-", dir="/tmp"))  # Unix socket paths are short
    config = config_from_mapping({
        "socket": str(directory / "api.sock"), "state_dir": str(directory / "state"), "listen": "127.0.0.1:0",
        "token": TOKEN, "max_queued_jobs": 48, "checkout_max_bytes": "256KiB", "shutdown_grace_seconds": 0,
    })
    engine = FakeSandboxes(programs=defaultdict(lambda: prints(b"ok\n")),  # any command prints and exits 0
                        artifacts_tar=tar_of([(member("out/report.xml"), b"<testsuite/>")]))
    try:
        with ServiceHost(config, sandboxes=engine.create) as host:
            assert host.service is not None and host.api is not None
            yield Served(host.service, host.api)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def created_job(answers: list[Answer]) -> Iterator[str]:
    for answer in answers:
        if answer.status == 201:
            yield json.loads(answer.body)["id"]


def test_job_api_survives_hostile_requests(served: Served, capfd: pytest.CaptureFixture[str]) -> None:
    JobClient(socket=served.service.config.socket, timeout=10).health()
    baseline = Usage.now()
    statuses: Counter[int] = Counter()

    with Tracebacks() as tracebacks:
        @fuzz(800)
        @given(inputs())
        def one(request: Input) -> None:
            INPUTS["job-api"] += 1
            data = request.data.replace(JOB, served.job_id(request.job))
            result = exchange(served.connect_tcp if request.tcp else served.connect_unix, data)
            check_answers(result, data)
            served.jobs.extend(created_job(result.answers))
            statuses.update(answer.status for answer in result.answers)
            tracebacks.check(data)

        one()
        client = JobClient(socket=served.service.config.socket, timeout=10)
        for job in served.jobs:  # what the fuzz left waiting for a checkout: each holds its log file open
            assert client.cancel(job).state in ("cancelled", "finished", "failed")
        host, port = served.servers.tcp_address
        last = JobClient(url=f"http://{host}:{port}", token=TOKEN, timeout=10.0).submit(spec())
        assert last.state == "awaiting_checkout"
        tracebacks.check(b"(the batch)")
    assert served.jobs, "no submit of the fuzz was accepted: the inputs never reached a job"
    assert "Traceback" not in capfd.readouterr().err  # nothing printed past the loggers either
    print(f"job-api: {len(served.jobs)} jobs created; answers by status: {dict(sorted(statuses.items()))}")
    # the last submit's job holds its log open, as every job waiting for its checkout does
    served.service.cancel(last.id)
    assert_settled(baseline, settle(baseline))

