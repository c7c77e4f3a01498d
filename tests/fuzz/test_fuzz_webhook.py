"""Fuzz the GitHub webhook through its real listener (runner/github/webhooks.py over loopback TCP).

A mutation fuzzer seeded from the stored payloads (tests/reference.py: octokit's examples, and the real
captures where shared/external/ is beside the checkout; under CI=true they must be): values swapped at the
paths the parser reads (action, workflow_job ids, labels, names, repository.full_name) and at random paths,
then the JSON text itself mutated (deep nesting, long digit runs, duplicate keys, stray bytes, invalid UTF-8).
Most inputs are SIGNED with the test secret, so they pass the signature check and reach the parsing and the
job service behind it (the real JobService on the fake engine, as the webhook's hooks); the rest are unsigned
or badly signed, or garble the framing: method, path, content type, Content-Length, Transfer-Encoding, GUID,
event.

For every input: each answer is well-formed HTTP, no 5xx but a 503 with Retry-After, no traceback in
the log and no thread dies; a signed input with a well-formed head is answered 200 or 400 (it reached
the parsing: never a 403). After the batch: a signed delivery is answered (within 10 s: the machine
may be busy), and the process is back to the threads and file descriptors it had before the batch.
"""

from __future__ import annotations

import copy
import json
import shutil
import socket
import tempfile
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runner.github.signature import sign
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.config.reading import config_from_mapping
from runner.service.github.webhook import Webhook
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.service import JobService
from tests.fuzz.fuzzing import INPUTS, fuzz
from tests.fuzz.wire import Tracebacks, Usage, assert_settled, check_answers, exchange, settle
from tests.reference import available_payloads

SECRET = b"webhook-fuzz-secret"
MAX_BODY = 256 * 1024
# Placeholders filled in per input (fixed width, so Content-Length holds): deliveries are deduplicated by
# GUID and by body digest, and hypothesis repeats itself, so each input gets its own GUID and body nonce.
NONCE_KEY = "fuzz_delivery"
NONCE = b'"fuzz_delivery": "000000000"'
GUID = b"00000000-0000-0000-0000-000000000000"
LABELS = ["microvm", "ubuntu-latest", "macos-11"]  # so mutated stored jobs reach the hooks (self-hosted is ours too)


@cache
def seeds() -> list[tuple[str, dict[str, Any]]]:
    """(event, payload) for every stored payload there is: octokit's examples, and where present the deleted
    `started` one and the captures."""
    found = [(stored.event, stored.json()) for stored in available_payloads()]
    assert len(found) >= 12, f"the stored payloads are missing: {len(found)} found"
    return found


def rarely(draw: st.DrawFn, one_in: int) -> bool:
    """True about once in `one_in` draws (hypothesis favours the bounds of `integers`, so not `== 0`)."""
    return draw(st.sampled_from([False] * (one_in - 1) + [True]))


# -- payload mutations --------------------------------------------------------------------------

READ_PATHS = [("action",), ("workflow_job",), ("workflow_job", "run_id"), ("workflow_job", "run_attempt"),
              ("workflow_job", "id"), ("workflow_job", "labels"), ("workflow_job", "name"),
              ("workflow_job", "conclusion"), ("workflow_job", "runner_name"), ("repository",),
              ("repository", "full_name")]
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, 1.5, 1e308, float("nan"),
    float("inf"), "", "\x00", "a\x00b", "\ud800", "a\udc00b", "\u202e", "x" * 5000, "queued", "completed",
    "in_progress", "waiting", "QUEUED", "a\nb", "../..", "octo/..", "../x", "Codertocat/Hello-World\n",
    "a" * 101 + "/b", [], [1], ["self-hosted"], ["microvm"] * 101, ["\ud800"], ["a\nb"], ["x" * 2000], [None],
    ["Self-Hosted", "MICROVM"], {}, {"full_name": "a/b"}, {"id": 1},
]
VALUES = st.one_of(st.sampled_from(ODD_VALUES), st.integers(), st.text(max_size=20),
                   st.floats(allow_nan=True, allow_infinity=True))


def paths_of(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value in a JSON document (dict keys and list indexes)."""
    found = [prefix] if prefix else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found += paths_of(item, (*prefix, key))
    return found


@cache
def seed_paths(index: int) -> list[tuple]:
    return paths_of(seeds()[index][1])


def put(doc: Any, path: tuple, value: Any, delete: bool = False) -> None:
    """Set (or delete) doc[path], creating missing objects on the way; a path through a scalar does nothing."""
    for key in path[:-1]:
        if isinstance(doc, dict):
            doc = doc.setdefault(key, {})
        elif isinstance(doc, list) and isinstance(key, int) and key < len(doc):
            doc = doc[key]
        else:
            return
    last = path[-1]
    if isinstance(doc, dict) or (isinstance(doc, list) and isinstance(last, int) and last < len(doc)):
        if delete:
            doc.pop(last, None) if isinstance(doc, dict) else doc.__delitem__(last)
        else:
            doc[last] = value


@st.composite
def payloads(draw: st.DrawFn) -> tuple[str, bytes]:
    index = draw(st.integers(0, len(seeds()) - 1))
    event, seed = seeds()[index]
    doc = copy.deepcopy(seed)
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 3]))):
        path = draw(st.sampled_from(READ_PATHS)) if draw(st.booleans()) else draw(st.sampled_from(seed_paths(index)))
        if rarely(draw, 6):
            put(doc, path, None, delete=True)
        else:
            put(doc, path, draw(VALUES))
    if isinstance(doc, dict):
        doc = {NONCE_KEY: "000000000", **doc}  # first, so json.dumps writes NONCE
    if rarely(draw, 10):
        doc = draw(st.sampled_from([[doc], "text", 7, None]))  # not an object
    body = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    if rarely(draw, 5):
        body = draw(text_mutation(body))
    return event, body


@st.composite
def text_mutation(draw: st.DrawFn, body: bytes) -> bytes:
    action = draw(st.sampled_from(["nest", "wrap", "digits", "duplicate", "byte", "truncate", "bom", "invalid"]))
    depth = draw(st.sampled_from([63, 64, 65, 1000, 5000]))
    inner = body[:-1] if body.endswith(b"}") else body
    if action == "nest":
        return inner + b', "workflow_job": ' + b"[" * depth + b"]" * depth + b"}"
    if action == "wrap":
        return b"[" * depth + body + b"]" * depth
    if action == "digits":
        digits = b"9" * draw(st.sampled_from([19, 20, 4301, 5000]))
        return inner + b', "workflow_job": {"run_id": ' + digits + b', "id": 1e999999}}'
    if action == "duplicate":
        return inner + b', "action": ' + draw(st.sampled_from([b"[]", b'"queued"', b"null", b"{}"])) + b"}"
    at = draw(st.integers(0, len(body)))
    if action == "byte":
        return body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1:]
    if action == "truncate":
        return body[:at]
    if action == "bom":
        return b"\xef\xbb\xbf" + body
    return body[:at] + b"\xed\xa0\x80\xff" + body[at:]  # an encoded surrogate and a byte UTF-8 never has


# -- requests -----------------------------------------------------------------------------------

OTHER_SECRET = b"not-the-secret"
SIGNATURES = {
    "good": lambda body: sign(SECRET, body),
    "unsigned": lambda body: "",
    "wrong": lambda body: sign(SECRET, body + b" "),
    "other-secret": lambda body: sign(OTHER_SECRET, body),
    "upper": lambda body: sign(SECRET, body).upper(),
    "short": lambda body: sign(SECRET, body)[:-1],
    "sha1": lambda body: "sha1=" + sign(SECRET, body)[7:],
    "space": lambda body: sign(SECRET, body) + " ",
    "not-hex": lambda body: "sha256=" + "g" * 64,
    "bare": lambda body: sign(SECRET, body)[7:],
}


@dataclass(frozen=True)
class Input:
    head: list[bytes]  # request line and headers, without the signature
    body: bytes  # with NONCE (when the mutations left it) and GUID placeholders
    signature: str  # a key of SIGNATURES
    chunked: bool = False
    pipelined: bool = False  # a signed ping follows on the same connection
    garbage: bytes = b""  # sent instead of everything else when set
    signed: bool = True  # signed with the secret, with a head that passes every check before the body

    def render(self, nonce: int) -> bytes:
        if self.garbage:
            return self.garbage
        body = self.body.replace(NONCE, b'"fuzz_delivery": "%09d"' % nonce, 1)
        guid = str(uuid.UUID(int=nonce)).encode()
        head = [line.replace(GUID, guid) for line in self.head]
        signature = SIGNATURES[self.signature](body)
        if signature:
            head.append(b"X-Hub-Signature-256: " + signature.encode())
        framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if self.chunked else body
        data = b"\r\n".join(head) + b"\r\n\r\n" + framed
        if self.pipelined:
            ping = b'{"zen": "%d"}' % nonce
            data += (b"POST /github/webhook HTTP/1.1\r\nContent-Type: application/json\r\nX-GitHub-Event: ping\r\n"
                     b"X-GitHub-Delivery: %s-ping\r\nX-Hub-Signature-256: %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (guid, sign(SECRET, ping).encode(), len(ping), ping))
        return data


@st.composite
def inputs(draw: st.DrawFn) -> Input:
    event, body = draw(payloads())
    if rarely(draw, 8):
        event = draw(st.sampled_from(["ping", "", "x" * 100, "workflow_run", "check_run", "Workflow_Job"]))
    guid = GUID.decode()
    if rarely(draw, 12):
        guid = draw(st.sampled_from(["", "../x", "a" * 101, "{}", "\u00e9", "g u i d"]))
    headers = {"Content-Type": "application/json", "X-GitHub-Event": event, "X-GitHub-Delivery": guid,
               "User-Agent": "GitHub-Hookshot/fuzz"}
    method, path, length, signature, chunked = "POST", "/github/webhook", b"%d" % len(body), "good", False
    signed = not rarely(draw, 4)
    if not signed:  # what an attacker without the secret, or a broken proxy, sends
        garble = draw(st.sampled_from([*(key for key in SIGNATURES if key != "good"), "method", "path",
                                       "content-type", "length", "no-length", "too-large", "chunked", "both"]))
        if garble in SIGNATURES:
            signature = garble
        elif garble == "method":
            method = draw(st.sampled_from(["GET", "PUT", "HEAD", "DELETE", "post", "OPTIONS"]))
        elif garble == "path":
            path = draw(st.sampled_from(["/", "/github/webhook/", "/github/webhooks", "/GITHUB/WEBHOOK", "*",
                                         "/github/webhook/../webhook", "http://x/github/webhook"]))
        elif garble == "content-type":
            headers["Content-Type"] = draw(st.sampled_from(["application/x-www-form-urlencoded", "", "text/json",
                                                            "application/jsonx", "application/json\x0b"]))
        elif garble == "length":
            length = b"%d" % max(0, len(body) + draw(st.sampled_from([-50, -1, 1, 50, 10**6])))
        elif garble == "no-length":
            length = b""
        elif garble == "too-large":
            length = draw(st.sampled_from([b"%d" % (MAX_BODY + 1), b"9" * 4301, b"-1", b"+5", b"1e3", b"0x10"]))
        else:
            headers["Transfer-Encoding"] = "chunked"
            chunked = True
            if garble == "chunked":
                length = b""
    elif rarely(draw, 10):  # signed, with a query string and an odd but valid content type
        path = "/github/webhook?x=1"
        headers["Content-Type"] = "Application/JSON; charset=utf-8"
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: hooks.example"]
    head += [f"{name}: {value}".encode() for name, value in headers.items()]
    if length:
        head.append(b"Content-Length: " + length)
    garbage = draw(st.binary(min_size=1, max_size=300)) if rarely(draw, 40) else b""
    return Input(head, body, signature, chunked, rarely(draw, 6), garbage, signed and not garbage)


# -- the service --------------------------------------------------------------------------------


@dataclass
class Served:
    service: JobService
    webhook: Webhook

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.webhook.port))


@pytest.fixture
def served() -> Iterator[Served]:
    directory = Path(tempfile.mkdtemp(prefix="mvc-fuzz-hook-", dir="/tmp"))
    (directory / "secret").write_bytes(SECRET + b"\n")
    config = config_from_mapping({"socket": str(directory / "api.sock"), "state_dir": str(directory / "state"),
                                  "shutdown_grace_seconds": 0,
                                  "webhook": {"listen": "127.0.0.1:0", "secret_path": str(directory / "secret"),
                                              "labels": list(LABELS), "max_body": MAX_BODY}})
    engine = FakeSandboxes(programs=defaultdict(lambda: prints(b"ok\n")))
    try:
        with ServiceHost(config, sandboxes=engine.create, serve_api=False) as host:
            assert host.service is not None and host.webhook is not None
            yield Served(host.service, host.webhook)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def signed_ping(served: Served) -> int:
    """A signed delivery with a new GUID and body, answered within 10 s: its status."""
    body = json.dumps({"zen": "Keep it logically awesome.", "hook_id": uuid.uuid4().int >> 80}).encode()
    request = (b"POST /github/webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-GitHub-Event: ping\r\n"
               b"X-GitHub-Delivery: %s\r\nX-Hub-Signature-256: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
               % (str(uuid.uuid4()).encode(), sign(SECRET, body).encode(), len(body), body))
    with socket.create_connection(("127.0.0.1", served.webhook.port), timeout=10.0) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def test_webhook_survives_hostile_deliveries(served: Served, capfd: pytest.CaptureFixture[str]) -> None:
    assert signed_ping(served) == 200
    baseline = Usage.now()
    statuses: Counter[int] = Counter()
    reached: Counter[str] = Counter()

    with Tracebacks() as tracebacks:
        @fuzz(700)
        @given(inputs())
        def one(request: Input) -> None:
            INPUTS["webhook"] += 1
            data = request.render(INPUTS["webhook"])
            result = exchange(served.connect, data)
            check_answers(result, data)
            statuses.update(answer.status for answer in result.answers)
            if request.signed:
                assert result.answers, f"a signed delivery got no answer: {result.raw[:200]!r}"
                first = result.answers[0]
                assert first.status in (200, 400), f"a signed delivery got {first.status} {first.body[:200]!r}"
                reached[json.loads(first.body)["message"].split(":")[0][:30]] += 1
            tracebacks.check(data)

        one()
        assert signed_ping(served) == 200
        tracebacks.check(b"(the batch)")
    assert "Traceback" not in capfd.readouterr().err  # nothing printed past the loggers either
    print(f"webhook: answers by status: {dict(sorted(statuses.items()))}; signed ones: {dict(reached.most_common(8))}")
    assert reached, "no signed input reached the parsing"
    assert_settled(baseline, settle(baseline))
