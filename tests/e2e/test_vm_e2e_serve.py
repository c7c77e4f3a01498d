"""`microvm-check serve` as a real process on real VMs: its own `webhook:` wiring (endpoint, pre-warm,
redelivery sweep), and its recovery after a `kill -9` in the middle of a job.

GitHub is a small HTTP server on 127.0.0.1 that the service's GitHub App settings point at
(`api_url`): a subprocess cannot be patched with `responses`, and `api_url` is a setting operators have
(GitHub Enterprise Server), so the sweep's requests are the real ones. Needs root, QEMU and the built
`base` template: failing under CI=true.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from runner.github.signature import sign
from runner.jobapi.client import JobAPIError, JobClient
from runner.vm.engine import LOCK_NAME
from runner.vm.sweep import processes_under
from tests.e2e.test_vm_e2e import QUEUED
from tests.e2e.vm_jobs import output, submit, templates, vm_root  # noqa: F401 (fixtures)
from tests.reference import captured

pytestmark = pytest.mark.vm
SECRET = b"webhook-secret-for-this-test"
FAILED_DELIVERY = 9  # the one the fake GitHub reports failed: the sweep must ask for it again


# -- serve as a process ---------------------------------------------------------------------------


class Serve:
    """One `microvm-check serve --config FILE` process; its stderr goes to a file the test can show."""

    def __init__(self, config: Path, stderr: Path) -> None:
        self.stderr_path = stderr
        env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
        env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"  # the fake GitHub is on loopback
        with stderr.open("ab") as err:
            self.proc = subprocess.Popen([str(Path(sys.executable).parent / "microvm-check"), "serve", "--config",
                                          str(config)], cwd="/", stderr=err, env=env)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_answering(self, client: JobClient) -> None:
        """Until the API answers (the service has started, swept its predecessor and serves)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                client.health()
                return
            except JobAPIError:
                if self.proc.poll() is not None:
                    pytest.fail(f"serve exited early ({self.proc.returncode}): {self.stderr()}")
                time.sleep(0.05)
        pytest.fail(f"serve never answered on its socket: {self.stderr()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(180)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


SERVICE_LOG_SHOWN = 20_000  # characters of a service's stderr that a failed test's report shows


@pytest.fixture
def serve(vm_root: Path) -> Iterator[Any]:
    """Starts `serve` processes on `vm_root`'s state; any still running at teardown is stopped."""
    started: list[Serve] = []

    def start(config: dict[str, Any]) -> Serve:
        path = vm_root / "service.yml"
        path.write_text(json.dumps({"socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"),
                                    "shutdown_grace_seconds": 0, **config}))  # JSON is YAML
        started.append(Serve(path, vm_root / "serve.stderr"))
        return started[-1]

    yield start
    for process in started:
        if process.proc.poll() is None:
            try:
                process.stop()
            finally:
                process.kill()
        # pytest shows a test's captured output only when it failed: then the service's own account is there
        print(f"-- the end of {process.stderr_path}:\n{process.stderr()[-SERVICE_LOG_SHOWN:]}")


def listening_webhook(client: JobClient, process: Serve) -> str:
    """The webhook's address from the host's status once it listens: the API answers first (the fleet's
    runners need it), and the webhook is the last part the host starts."""
    deadline = time.monotonic() + 120
    while (webhook := client.status()["listening"]["webhook"]) is None:
        assert time.monotonic() < deadline and process.proc.poll() is None, process.stderr()
        time.sleep(0.05)
    return str(webhook)


# -- a fake GitHub for the sweep ------------------------------------------------------------------


class FakeGitHub(http.server.ThreadingHTTPServer):
    """`GET /app/hook/deliveries` (one delivery that succeeded, one that failed) and
    `POST /app/hook/deliveries/{id}/attempts`; it records every request it got."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _GitHubHandler)
        self.requests: list[tuple[str, str, str]] = []  # method, path, Authorization
        self.redelivery_asked = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @staticmethod
    def deliveries() -> list[dict[str, Any]]:
        """GitHub's `hook-delivery-item` shape (as tests/github/test_github_deliveries.py), a minute old."""
        stamp = datetime.fromtimestamp(time.time() - 60, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return [{"id": id_, "guid": f"guid-{id_}", "delivered_at": stamp, "redelivery": False, "duration": 0.27,
                 "status": "OK" if code == 200 else "Invalid HTTP Response: 502", "status_code": code,
                 "event": "workflow_job", "action": "queued", "installation_id": 123, "repository_id": 456}
                for id_, code in ((10, 200), (FAILED_DELIVERY, 502))]


class _GitHubHandler(http.server.BaseHTTPRequestHandler):
    server: FakeGitHub

    def do_GET(self) -> None:
        self._record()
        if self.path.split("?")[0] == "/app/hook/deliveries":
            self._answer(200, FakeGitHub.deliveries())
        else:
            self._answer(404, {"message": "Not Found"})

    def do_POST(self) -> None:
        self._record()
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == f"/app/hook/deliveries/{FAILED_DELIVERY}/attempts":
            self._answer(202, {})
            self.server.redelivery_asked.set()
        else:
            self._answer(404, {"message": "Not Found"})

    def _record(self) -> None:
        self.server.requests.append((self.command, self.path, self.headers.get("Authorization", "")))

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    server = FakeGitHub()
    server.thread.start()
    yield server
    server.shutdown()
    server.server_close()
    server.thread.join()


# -- the tests ------------------------------------------------------------------------------------


def test_serve_wires_its_webhook_prewarm_and_redelivery_sweep(serve, vm_root: Path, github: FakeGitHub,
                                                               tmp_path: Path) -> None:
    """The `webhook:` section of serve's own config: a signed `workflow_job queued` delivery to its
    endpoint warms a VM that the run's submit then gets, and the redelivery sweep asks (the fake)
    GitHub, as the App, for its failed deliveries and to redeliver the failed one."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = tmp_path / "app.pem"
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    app = tmp_path / "github.yml"
    app.write_text(f"app_id: 1\nprivate_key_path: {pem}\napi_url: {github.url}\n")
    secret = tmp_path / "webhook-secret"
    secret.write_bytes(SECRET)
    process = serve({"prewarm": {"max_vms": 1},
                     "webhook": {"listen": "127.0.0.1:0", "secret_path": str(secret), "labels": ["self-hosted"],
                                 "redeliver_every": 30, "github_config": str(app)}})
    client = JobClient(socket=str(vm_root / "api.sock"))
    process.wait_answering(client)
    assert client.health().warm == 0
    webhook = listening_webhook(client, process)  # the port the kernel chose for port 0
    assert webhook.startswith("127.0.0.1:") and webhook != "127.0.0.1:0", webhook
    assert f"GitHub's webhook on {webhook}" in process.stderr()

    queued = captured(QUEUED)
    body = json.dumps(queued).encode()
    answer = requests.post(f"http://{webhook}/github/webhook", data=body, timeout=30, headers={
        "Content-Type": "application/json", "X-GitHub-Event": "workflow_job",
        "X-GitHub-Delivery": str(uuid.uuid4()), "X-Hub-Signature-256": sign(SECRET, body)},
        proxies={"http": None, "https": None})
    assert (answer.status_code, answer.json()) == (200, {"message": f"prewarming for job {queued['workflow_job']['id']}"})
    assert client.health().warm == 1  # the delivery reached the service: a VM is being warmed for the run

    # The warm VM goes to the run's first submit once it is restored; a submit that comes earlier runs
    # cold and leaves it waiting, so the run submits again (each job gives the restore time to finish).
    run = {"repository": queued["repository"]["full_name"], "run_id": queued["workflow_job"]["run_id"],
           "run_attempt": 1}
    records = []
    for _ in range(4):
        job = submit(client, "echo warm", **run)
        assert output(client, job) == b"warm\n"
        records.append(client.get(job))
        if records[-1].warm:
            break
    assert [r.warm for r in records][-1:] == [True], records
    assert client.health().warm == 0

    # The sweep's first pass comes redeliver_every (30 s) after the start.
    assert github.redelivery_asked.wait(180), (github.requests, process.stderr())
    methods = [(method, path.split("?")[0]) for method, path, _ in github.requests]
    assert methods[:2] == [("GET", "/app/hook/deliveries"), ("POST", f"/app/hook/deliveries/{FAILED_DELIVERY}/attempts")]
    for _, _, authorization in github.requests[:2]:  # as the App: a JWT signed with its key
        claims = jwt.decode(authorization.removeprefix("Bearer "), key.public_key(), algorithms=["RS256"])
        assert claims["iss"] in (1, "1")
    assert process.stop() == 0, process.stderr()


def test_serve_recovers_after_kill_9_in_the_middle_of_a_job(serve, vm_root: Path) -> None:
    """`kill -9` of serve while a job runs: the next serve on the same state dir ends that job as failed
    with the reason, leaves nothing of the dead one's VMs (processes, directories), and runs new jobs."""
    state = vm_root / "state"
    config = {"prewarm": {"max_vms": 0}}
    first = serve(config)
    client = JobClient(socket=str(vm_root / "api.sock"))
    first.wait_answering(client)
    job = submit(client, "echo started; sleep 300", timeout_seconds=600)
    for entry in client.logs(job):
        if entry.data == b"started\n":
            break
    running = client.get(job)
    assert running.state == "running" and running.vm_id
    vmms = {pid: _cmdline(pid) for pid in processes_under(state / "vms")}
    vm_dirs = {p.name for p in (state / "vms").iterdir() if p.name != LOCK_NAME}
    assert vmms and running.vm_id in vm_dirs

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    second = serve(config)
    second.wait_answering(client)

    record = client.get(job)
    assert record.state == "failed" and record.error == "the service stopped while this job was active", record
    assert [pid for pid, cmdline in vmms.items() if _cmdline(pid) == cmdline] == [], "a dead service's VMM survived"
    assert vm_dirs & {p.name for p in (state / "vms").iterdir()} == set(), "a dead service's VM directory was left"
    assert not (state / "jobs" / job / "checkout.tar").exists()
    again = submit(client, "echo again")
    assert output(client, again) == b"again\n"
    assert (client.get(again).state, client.get(again).exit_code) == ("finished", 0)
    assert second.stop() == 0, second.stderr()
    assert processes_under(state / "vms") == []


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None
