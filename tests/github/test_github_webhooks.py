"""The webhook endpoint over a real loopback socket, fed every stored payload."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from runner.github.jobs import CompletedJob, InProgressJob, QueuedJob
from runner.github.signature import sign
from runner.github.webhooks import WebhookConfig, WebhookReceiver, WebhookServer
from tests.github.github_fakes import event_name, load_payload, webhook_payloads

SECRET = b"webhook-secret-for-tests"
MAX_BODY = 512 * 1024


@dataclass
class RecordingHooks:
    queued: list[QueuedJob] = field(default_factory=list)
    in_progress: list[InProgressJob] = field(default_factory=list)
    completed: list[CompletedJob] = field(default_factory=list)
    fail_next: bool = False

    def prewarm(self, job: QueuedJob) -> None:
        self._maybe_fail()
        self.queued.append(job)

    def job_in_progress(self, job: InProgressJob) -> None:
        self._maybe_fail()
        self.in_progress.append(job)

    def job_completed(self, job: CompletedJob) -> None:
        self._maybe_fail()
        self.completed.append(job)

    def _maybe_fail(self) -> None:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("job service unavailable")


@dataclass
class Reply:
    status: int
    message: str
    headers: dict[str, str]


@pytest.fixture
def hooks() -> RecordingHooks:
    return RecordingHooks()


@pytest.fixture
def make_server(hooks):
    servers = []

    def make(labels: tuple[str, ...] = ("microvm",)) -> WebhookServer:
        receiver = WebhookReceiver(WebhookConfig(secret=SECRET, labels=labels, max_body=MAX_BODY), hooks)
        server = WebhookServer(receiver, "127.0.0.1", 0)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def server(make_server) -> WebhookServer:
    return make_server()


def send(server: WebhookServer, body: bytes, *, method: str = "POST", path: str = "/github/webhook",
         headers: dict[str, str] | None = None, send_body: bool = True) -> Reply:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.putrequest(method, path, skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        connection.endheaders(body if send_body else None)
        response = connection.getresponse()
        text = response.read()
        return Reply(response.status, json.loads(text)["message"], dict(response.getheaders()))
    finally:
        connection.close()


def github_headers(body: bytes, event: str, delivery: str | None = None) -> dict[str, str]:
    """The headers GitHub sends (see the WEBHOOKS OpenAPI fragment), correctly signed."""
    return {
        "User-Agent": "GitHub-Hookshot/123abc",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "X-GitHub-Event": event,
        "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
        "X-GitHub-Hook-ID": "123",
        "X-GitHub-Hook-Installation-Target-Type": "integration",
        "X-GitHub-Hook-Installation-Target-ID": "42",
        "X-Hub-Signature-256": sign(SECRET, body),
    }


def deliver(
    server: WebhookServer, payload: dict | bytes, event: str = "workflow_job", delivery: str | None = None
) -> Reply:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return send(server, body, headers=github_headers(body, event, delivery))


# What each stored payload leads to when our labels cover some of the stored jobs: only these call
# the hooks. Completed jobs are reported whatever their conclusion; in_progress names the runner that took
# the job (the tarantool one asks for labels that are not ours); queued.with-deployment asks for "k8s",
# which is not ours, and waiting/started are accepted but ignored.
OUR_LABELS = ("microvm", "macos-11", "ubuntu-latest")
EXPECTED_QUEUED = {
    "queued.payload.json": QueuedJob(
        repository="Codertocat/Hello-World", run_id=2202229078, run_attempt=1, job_id=289782451,
        job_name="update", labels=("ubuntu-latest",),
    ),
    "github-aws-runners.workflow_job.queued.self-hosted.json": QueuedJob(
        repository="github-aws-runners/terraform-aws-github-runner", run_id=1068820843, run_attempt=1,
        job_id=3169272040, job_name="build", labels=("self-hosted",),
    ),
}
EXPECTED_IN_PROGRESS = {
    "in_progress.payload.json": InProgressJob(
        repository="Codertocat/Hello-World", run_id=2202229078, run_attempt=1, job_id=289782451,
        job_name="Analyze (javascript)", labels=("ubuntu-latest",), runner_name="GitHub Actions 5",
    ),
    "in_progress.with-queued-steps.payload.json": InProgressJob(
        repository="wolfy1339/github-events-schemas", run_id=5373506832, run_attempt=1, job_id=14541957942,
        job_name="Do examples need to be regenerated?", labels=("ubuntu-latest",), runner_name="GitHub Actions 6",
    ),
}
EXPECTED_COMPLETED = {
    "completed.failure.with-organization.payload.json": CompletedJob(
        repository="Codertocat/Hello-World", run_id=2202229078, run_attempt=1, job_id=289782451,
        job_name="linters", labels=("ubuntu-latest",), conclusion="failure", runner_name="GitHub Actions 5",
    ),
    "completed.success.with-organization.payload.json": CompletedJob(
        repository="Codertocat/Hello-World", run_id=2202229078, run_attempt=1, job_id=289782451,
        job_name="linters", labels=("ubuntu-latest",), conclusion="success", runner_name="GitHub Actions 5",
    ),
    "tarantool-job-rerunner@a5e5a579.workflow_job.completed.failure.runner-tntmac06.json": CompletedJob(
        repository="tarantool/tarantool", run_id=2934728824, run_attempt=1, job_id=8039369388,
        job_name="osx_11_lto", labels=("macos-11",), conclusion="failure", runner_name="tntmac06",
    ),
}


@pytest.mark.parametrize("path", webhook_payloads(), ids=lambda path: path.name)
def test_every_stored_payload_is_accepted_and_routed(make_server, hooks, path) -> None:
    server = make_server(labels=OUR_LABELS)
    reply = deliver(server, path.read_bytes(), event_name(path))
    assert reply.status == 200, reply.message
    assert hooks.queued == ([EXPECTED_QUEUED[path.name]] if path.name in EXPECTED_QUEUED else [])
    assert hooks.in_progress == ([EXPECTED_IN_PROGRESS[path.name]] if path.name in EXPECTED_IN_PROGRESS else [])
    assert hooks.completed == ([EXPECTED_COMPLETED[path.name]] if path.name in EXPECTED_COMPLETED else [])


def test_octokit_queued_example_prewarms_when_its_labels_are_ours(make_server, hooks) -> None:
    server = make_server(labels=("Ubuntu-Latest",))  # GitHub matches labels case-insensitively
    assert deliver(server, load_payload("queued.payload.json")).status == 200
    assert hooks.queued == [
        QueuedJob(repository="Codertocat/Hello-World", run_id=2202229078, run_attempt=1, job_id=289782451,
                  job_name="update", labels=("ubuntu-latest",)),
    ]


@pytest.mark.parametrize("conclusion", ["cancelled", "skipped", "timed_out", None])
def test_completed_is_reported_whatever_the_conclusion(make_server, hooks, conclusion) -> None:
    server = make_server(labels=OUR_LABELS)
    payload = load_payload("completed.failure.with-organization.payload.json")
    payload["workflow_job"]["conclusion"] = conclusion
    assert deliver(server, payload).status == 200
    assert [job.conclusion for job in hooks.completed] == [conclusion]


def test_completed_jobs_for_other_labels_are_ignored(server, hooks) -> None:
    reply = deliver(server, load_payload("completed.success.with-organization.payload.json"))
    assert reply.status == 200 and "not ours" in reply.message
    assert hooks.completed == []


def test_queued_for_self_hosted_plus_a_foreign_label_is_not_ours(make_server, hooks) -> None:
    server = make_server(labels=("k8s-other",))
    assert deliver(server, load_payload("queued.with-deployment.payload.json")).status == 200
    assert hooks.queued == []
    server = make_server(labels=("k8s",))
    assert deliver(server, load_payload("queued.with-deployment.payload.json")).status == 200
    assert [job.labels for job in hooks.queued] == [("self-hosted", "k8s")]


@pytest.mark.parametrize("action", ["waiting", "started", "a_future_action", None])
def test_other_actions_are_accepted_and_ignored(make_server, hooks, action) -> None:
    server = make_server(labels=("ubuntu-latest",))
    payload = load_payload("queued.payload.json")
    payload["action"] = action
    reply = deliver(server, payload)
    assert reply.status == 200 and "ignored" in reply.message
    assert hooks.queued == [] and hooks.in_progress == [] and hooks.completed == []


def test_in_progress_without_a_runner_name_is_ignored(make_server, hooks) -> None:
    """Nothing can be bound to a job whose runner GitHub does not name."""
    server = make_server(labels=("ubuntu-latest",))
    payload = load_payload("in_progress.payload.json")
    payload["workflow_job"]["runner_name"] = None
    reply = deliver(server, payload)
    assert reply.status == 200 and "ignored" in reply.message
    assert hooks.in_progress == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p["workflow_job"].pop("labels"),
        lambda p: p["workflow_job"].update(labels="ubuntu-latest"),
        lambda p: p["workflow_job"].update(run_id="2202229078"),
        lambda p: p["workflow_job"].update(id=-1),
        lambda p: p["repository"].update(full_name="../../etc"),
        lambda p: p.pop("repository"),
        lambda p: p.update(workflow_job=None),
    ],
)
def test_malformed_jobs_are_accepted_and_ignored(make_server, hooks, mutate) -> None:
    server = make_server(labels=("ubuntu-latest",))
    payload = load_payload("queued.payload.json")
    mutate(payload)
    reply = deliver(server, payload)
    assert reply.status == 200 and "ignored" in reply.message
    assert hooks.queued == []


def test_missing_run_attempt_defaults_to_the_first(make_server, hooks) -> None:
    server = make_server(labels=("ubuntu-latest",))
    payload = load_payload("queued.payload.json")
    del payload["workflow_job"]["run_attempt"]
    payload["an_extra_field"] = {"from": "the future"}
    assert deliver(server, payload).status == 200
    assert hooks.queued[0].run_attempt == 1


def test_each_delivery_is_processed_once(make_server, hooks) -> None:
    server = make_server(labels=OUR_LABELS)
    payload = load_payload("completed.success.with-organization.payload.json")
    delivery = str(uuid.uuid4())
    assert deliver(server, payload, delivery=delivery).status == 200
    second = deliver(server, payload, delivery=delivery)
    assert second.status == 200 and "already processed" in second.message
    assert len(hooks.completed) == 1
    payload["workflow_job"]["run_attempt"] = 2  # a re-run of the job is a new event
    assert deliver(server, payload).status == 200
    assert [job.run_attempt for job in hooks.completed] == [1, 2]


def test_a_replayed_body_under_a_new_guid_is_not_processed_again(make_server, hooks) -> None:
    server = make_server(labels=OUR_LABELS)
    body = json.dumps(load_payload("queued.payload.json")).encode()
    assert deliver(server, body).status == 200
    replay = deliver(server, body)  # same signed body, fresh X-GitHub-Delivery
    assert replay.status == 200 and "already processed" in replay.message
    assert len(hooks.queued) == 1


@pytest.mark.parametrize("guid", ["x" * 101, "a b", "id\r\nInjected: 1", "../x"])
def test_malformed_delivery_ids_are_400(server, guid) -> None:
    headers = github_headers(BODY, "workflow_job")
    headers["X-GitHub-Delivery"] = guid.replace("\r\n", "%0D%0A")
    assert send(server, BODY, headers=headers).status == 400


def test_a_failed_delivery_is_processed_when_redelivered(make_server, hooks) -> None:
    server = make_server(labels=OUR_LABELS)
    payload = load_payload("completed.failure.with-organization.payload.json")
    delivery = str(uuid.uuid4())
    hooks.fail_next = True
    failed = deliver(server, payload, delivery=delivery)
    assert failed.status == 500 and "job service" not in failed.message  # no internals leak
    assert deliver(server, payload, delivery=delivery).status == 200
    assert len(hooks.completed) == 1


BODY = json.dumps(load_payload("queued.payload.json")).encode()


def test_missing_signature_is_403(server, hooks) -> None:
    headers = github_headers(BODY, "workflow_job")
    del headers["X-Hub-Signature-256"]
    reply = send(server, BODY, headers=headers)
    assert reply.status == 403 and "missing" in reply.message


def test_wrong_signature_is_403(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    headers["X-Hub-Signature-256"] = sign(b"another secret", BODY)
    reply = send(server, BODY, headers=headers)
    assert reply.status == 403 and "wrong" in reply.message


def test_signature_of_another_body_is_403(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    tampered = BODY.replace(b"Hello-World", b"Hello-Xorld")
    assert send(server, tampered, headers=headers).status == 403


def test_non_post_is_405(server) -> None:
    reply = send(server, b"", method="GET", headers={})
    assert reply.status == 405 and reply.headers["Allow"] == "POST"


def test_other_paths_are_404(server) -> None:
    assert send(server, BODY, path="/", headers=github_headers(BODY, "workflow_job")).status == 404


def test_form_encoded_body_is_415(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    headers["Content-Type"] = "application/x-www-form-urlencoded"
    reply = send(server, BODY, headers=headers)
    assert reply.status == 415 and "application/json" in reply.message


def test_json_with_charset_is_accepted(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    headers["Content-Type"] = "application/json; charset=utf-8"
    assert send(server, BODY, headers=headers).status == 200


def test_oversize_body_is_413_before_it_is_sent(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    headers["Content-Length"] = str(MAX_BODY + 1)
    reply = send(server, b"", headers=headers, send_body=False)  # the server must not wait for the body
    assert reply.status == 413 and reply.headers["Connection"] == "close"


def test_missing_content_length_is_411(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    del headers["Content-Length"]
    assert send(server, b"", headers=headers, send_body=False).status == 411


@pytest.mark.parametrize("length", ["²", "1²", "¹", "-1", "0x10", "5, 6"])
def test_an_invalid_content_length_is_400_with_an_answer(server, length) -> None:
    """RFC 9112 6.3: an invalid Content-Length makes the framing unreadable, answered 400 and closed.
    str.isdigit() accepts "²"; the server must still answer instead of dropping the connection."""
    headers = github_headers(BODY, "workflow_job")
    headers["Content-Length"] = length  # latin-1, so http.client sends it as it is
    reply = send(server, b"", headers=headers, send_body=False)
    assert reply.status == 400 and reply.headers["Connection"] == "close"
    assert reply.message.endswith("Content-Length") or "Content-Length headers" in reply.message


def test_missing_delivery_id_is_400(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    del headers["X-GitHub-Delivery"]
    assert send(server, BODY, headers=headers).status == 400


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_signed_but_unreadable_body_is_400(server, hooks, body) -> None:
    assert send(server, body, headers=github_headers(body, "workflow_job")).status == 400


def test_ping_is_answered(server) -> None:
    reply = deliver(server, {"zen": "Keep it logically awesome.", "hook_id": 1}, event="ping")
    assert reply.status == 200 and reply.message == "pong"


def test_pull_request_events_are_ignored(server, hooks) -> None:
    reply = deliver(server, load_payload("listendev-lstn.pull_request.opened.from-fork.json"), event="pull_request")
    assert reply.status == 200 and "ignored" in reply.message



@pytest.mark.parametrize("digits", ["1" * 4301, "1" * 100, "1" + "0" * 18])  # past int()'s limit, h11's, ours
def test_a_content_length_of_many_digits_is_413_with_an_answer(server, digits: str) -> None:
    """A huge declared body is too large, not malformed nor missing (issue 17's fuzz findings: 400, 411)."""
    headers = github_headers(BODY, "workflow_job")
    headers["Content-Length"] = digits
    reply = send(server, b"", headers=headers, send_body=False)
    assert reply.status == 413 and reply.headers["Connection"] == "close"


def test_signed_json_nested_1000_deep_is_400(server) -> None:
    body = b"[" * 1000 + b"]" * 1000
    reply = send(server, body, headers=github_headers(body, "workflow_job"))
    assert reply.status == 400 and "nested deeper" in reply.message


def test_a_malformed_signature_is_403_before_the_body_is_sent(server) -> None:
    headers = github_headers(BODY, "workflow_job")
    headers["X-Hub-Signature-256"] = "sha1=0123"
    reply = send(server, b"", headers=headers, send_body=False)  # the server must not wait for the body
    assert reply.status == 403 and "malformed" in reply.message


def test_slow_bodies_do_not_take_the_delivery_slots(make_server, hooks) -> None:
    """20 bodies at one byte a second, a well-formed but wrong signature each: 12 signed deliveries still get in."""
    server = make_server(labels=OUR_LABELS)
    head = (b"POST /github/webhook HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
            b"X-GitHub-Delivery: 1\r\nX-Hub-Signature-256: sha256=" + b"0" * 64 + b"\r\n\r\n")
    payloads = [load_payload("queued.payload.json") for _ in range(12)]
    for n, payload in enumerate(payloads):
        payload["workflow_job"]["id"] += n  # twelve different jobs, so none is a replay of another
    with contextlib.ExitStack() as stack:
        slow = [stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=10)) for _ in range(20)]
        for sock in slow:
            sock.sendall(head)
        for _ in range(2):
            for sock in slow:
                sock.sendall(b" ")
            time.sleep(1.0)
        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(lambda p: deliver(server, p).status, payloads))
    assert statuses == [200] * 12
    assert len(hooks.queued) == 12


def test_a_delivery_that_expects_100_continue_gets_it_once_its_head_passed(server) -> None:
    """The connection loop reads the body: it says 100 Continue itself, after the head's checks (it never did)."""
    body = json.dumps({"zen": "Keep it logically awesome.", "hook_id": 1}).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in github_headers(body, "ping").items())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"POST /github/webhook HTTP/1.1\r\nHost: x\r\n{head}Expect: 100-continue\r\n\r\n".encode())
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        answer = b""
        while not answer.endswith(b"}") and (data := sock.recv(65536)):
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b'{"message": "pong"}')
