"""A fake GitHub for the runner fleet: the REST endpoints through `responses`, a job queue in a directory.

Every REST answer is built from GitHub's own example bodies (tests/reference.py) and every
generate-jitconfig request is validated against its OpenAPI request schema, so the fleet is held to
GitHub's shapes. The JIT config it hands out is what the stand-in runner (standin_runner.py) reads:
the queue directory it takes its one job from. Jobs are announced to the service as signed
`workflow_job queued` deliveries built from octokit's example payload.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import itertools
import json
import os
import re
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import responses

from tests.github.github_fakes import (
    API,
    INSTALLATION_ID,
    TOKEN_OP,
    assert_valid_request,
    example,
    load_operations,
)
from tests.reference import Payload, stored

JIT_OP = "POST /orgs/{org}/actions/runners/generate-jitconfig"
LIST_OP = "GET /orgs/{org}/actions/runners"
QUEUED = stored("queued.payload.json")
FAILED = stored("completed.failure.with-organization.payload.json")
FORK_PR = stored("listendev-lstn.pull_request.opened.from-fork.json")  # captured: optional


@dataclass
class Registered:
    id: int
    name: str
    labels: list[str]
    deleted: bool = False


@dataclass
class FakeGitHub:
    org: str
    queue: Path
    webhook_secret: bytes
    operations: dict[str, Any] = field(default_factory=load_operations)
    runners: dict[int, Registered] = field(default_factory=dict)
    deletes: list[int] = field(default_factory=list)
    webhook_port: int | None = None
    _ids: Any = field(default_factory=lambda: itertools.count(9000))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        for sub in ("jobs", "claimed"):
            (self.queue / sub).mkdir(parents=True, exist_ok=True)
            (self.queue / sub).chmod(0o777)  # the runner user renames job files in, as GitHub's broker would hand out

    # -- REST -----------------------------------------------------------------------------------

    def install(self, mock: responses.RequestsMock) -> None:
        base = f"{API}/orgs/{self.org}/actions/runners"
        mock.add(responses.POST, f"{API}/app/installations/{INSTALLATION_ID}/access_tokens",
                 json=example(self.operations, TOKEN_OP, "201"), status=201)
        mock.add_callback(responses.POST, f"{base}/generate-jitconfig", callback=self._jitconfig)
        mock.add_callback(responses.GET, re.compile(re.escape(base) + r"(\?.*)?$"), callback=self._list)
        mock.add_callback(responses.DELETE, re.compile(re.escape(base) + r"/\d+$"), callback=self._delete)
        mock.add_passthru("http://127.0.0.1")

    def _jitconfig(self, request: Any) -> tuple[int, dict, str]:
        path = "/orgs/{org}/actions/runners/generate-jitconfig"
        body = assert_valid_request(request.body, "POST_orgs_org_actions_runners_generate-jitconfig.json", path, "post")
        answer = example(self.operations, JIT_OP, "201")
        with self._lock:
            runner = Registered(next(self._ids), body["name"], list(body["labels"]))
            self.runners[runner.id] = runner
        answer["runner"].update(id=runner.id, name=runner.name, labels=self._labels(runner))
        jit = {"runner_id": runner.id, "name": runner.name, "queue": str(self.queue)}
        answer["encoded_jit_config"] = base64.b64encode(json.dumps(jit).encode()).decode()
        return 201, {}, json.dumps(answer)

    def _list(self, request: Any) -> tuple[int, dict, str]:
        template = example(self.operations, LIST_OP, "200")["runners"][0]
        listed = []
        for runner in self.listed():
            item = copy.deepcopy(template)
            busy = self.job_of(runner.name) is not None
            item.update(id=runner.id, name=runner.name, status="online" if busy else "offline", busy=busy,
                        ephemeral=True, labels=self._labels(runner))
            listed.append(item)
        return 200, {}, json.dumps({"total_count": len(listed), "runners": listed})

    def _delete(self, request: Any) -> tuple[int, dict, str]:
        runner_id = int(request.url.rsplit("/", 1)[1])
        with self._lock:
            self.deletes.append(runner_id)
            runner = self.runners.get(runner_id)
            if runner is None or runner.deleted or self._finished(runner.name):
                return 404, {}, json.dumps({"message": "Not Found"})
            runner.deleted = True
        return 204, {}, ""

    def _labels(self, runner: Registered) -> list[dict[str, Any]]:
        return [{"id": n, "name": name, "type": "custom"} for n, name in enumerate(runner.labels, start=100)]

    # -- what GitHub knows -------------------------------------------------------------------------

    def listed(self) -> list[Registered]:
        """Registered, not deleted, and not yet removed by GitHub after its one job (JIT runners are)."""
        with self._lock:
            return [r for r in self.runners.values() if not r.deleted and not self._finished(r.name)]

    def claimed(self) -> list[Path]:
        return sorted((self.queue / "claimed").glob("*.json"))

    def job_of(self, runner_name: str) -> Path | None:
        return next((p for p in self.claimed() if p.stem.endswith("." + runner_name)), None)

    def _finished(self, runner_name: str) -> bool:
        job = self.job_of(runner_name)
        return job is not None and "result" in _read_claimed(job)

    def results(self) -> list[dict[str, Any]]:
        done = [_read_claimed(p) for p in self.claimed()]
        return [job for job in done if "result" in job]

    # -- the queue and the webhook -------------------------------------------------------------------

    def enqueue(self, job_id: int, steps: list[dict[str, Any]], labels: list[str], **fields: Any) -> dict[str, Any]:
        job = {"job_id": job_id, "run_id": 700000 + job_id, "run_attempt": 1, "repository": "listendev/lstn",
               "job": "check", "workflow_ref": "listendev/lstn/.github/workflows/ci.yml@refs/heads/main",
               "event": "pull_request_target", "event_payload": json.loads(FORK_PR.read_text()),
               "steps": steps, **fields}
        # Whole and writable before it appears under its name: idle runners poll `jobs/*.json` and take
        # a job the moment it is there (a dot name is never matched; the file stays the test's own).
        partial = self.queue / "jobs" / f".{job_id:06d}.json.partial"
        partial.write_text(json.dumps(job))
        partial.chmod(0o666)  # the runner writes its result back into it
        os.replace(partial, self.queue / "jobs" / f"{job_id:06d}.json")
        self.deliver_queued(job, labels)
        return job

    def deliver_queued(self, job: dict[str, Any], labels: list[str]) -> None:
        self._deliver(QUEUED, job, labels)

    def deliver_failed(self, job: dict[str, Any], labels: list[str], runner_name: str) -> None:
        """What GitHub sends when it loses the runner of a job: the job completed, failed."""
        self._deliver(FAILED, job, labels, runner_name=runner_name, conclusion="failure")

    def _deliver(self, example_path: Payload, job: dict[str, Any], labels: list[str], **more: Any) -> None:
        payload = json.loads(example_path.read_text())
        payload["workflow_job"].update(id=job["job_id"], run_id=job["run_id"], run_attempt=job["run_attempt"],
                                       labels=labels, name=job["job"], **more)
        payload["repository"]["full_name"] = job["repository"]
        body = json.dumps(payload).encode()
        digest = hmac.new(self.webhook_secret, body, hashlib.sha256).hexdigest()
        answer = requests.post(f"http://127.0.0.1:{self.webhook_port}/github/webhook", data=body, timeout=30, headers={
            "Content-Type": "application/json", "X-GitHub-Event": "workflow_job",
            "X-GitHub-Delivery": str(uuid.uuid4()), "X-Hub-Signature-256": f"sha256={digest}"})
        assert answer.status_code == 200, answer.text


def _read_claimed(path: Path) -> dict[str, Any]:
    """A claimed job as its runner last wrote it; {} while the runner is still writing it.

    The stand-in runner rewrites the file in place (tests/fleet/standin_runner.py), and must: a
    rename would leave a file of the runner's own uid behind, which the rig's teardown rightly
    refuses. So a read can meet a half-written file (a CI run failed on one with a JSONDecodeError);
    it counts as a report that has not arrived yet, and the next poll reads it whole."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, FileNotFoundError):
        return {}
