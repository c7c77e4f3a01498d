"""What a registered runner's job may be is not the job's to say (issue 40 item 5).

A registered runner's credential outlives its jobs and sits in every step's environment, so a step can
call the job-completed and job-started hooks itself. Without a webhook, the operator holds the runner to
the repository its credential names; with one, only the run GitHub's signed `workflow_job in_progress`
delivery put on the runner binds it; and on any host a job the fork guard refused submits nothing.

The real service (no VM: nothing is uploaded) with a credential `microvm-check runner credential` issued;
a step's calls are made in-process with that credential, which is all that tells the service who calls.
GitHub's deliveries are built from real captured payloads and signed with the service's webhook secret.
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from runner.github.signature import sign
from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import JobSummary, Verdict
from tests.fleet.conftest import LABELS
from tests.fleet.test_fleet import wait_until
from tests.fleet.test_fleet_access import RUN_ID, spec, started
from tests.reference import stored

NAME = "mvc-registered-1"
OURS = "listendev/lstn"  # the runner's own repository (B in the issue)
OTHER = "octo-org/other"  # another repository, whose egress policy a step of B's job is after (A)
IN_PROGRESS = stored("tarantool-job-rerunner@head.workflow_job.in_progress.in_progress.runner-ghacts-shared-1-2-n1.json")
COMPLETED = stored("tarantool-job-rerunner@a5e5a579.workflow_job.completed.failure.runner-tntmac06.json")


@contextmanager
def registered_service(root: Path, *, webhook: bool, repository: str | None) -> Iterator[tuple[Any, str]]:
    """The service (a webhook on loopback when `webhook`) and the credential of runner NAME, held to
    `repository` when given: (host, the runner's token)."""
    from runner.cli import main
    from runner.service.config.reading import load_config
    from runner.service.host.assembly import ServiceHost

    secret = root / "webhook-secret"
    secret.write_text(secrets.token_hex(16))
    settings: dict[str, Any] = {"socket": str(root / "api.sock"), "state_dir": str(root / "state")}
    if webhook:
        settings["webhook"] = {"listen": "127.0.0.1:0", "secret_path": str(secret), "labels": LABELS}
    path = root / "service.yml"
    path.write_text(yaml.safe_dump(settings))
    runner_dir = root / "runner"
    runner_dir.mkdir(exist_ok=True)
    held = ["--repository", repository] if repository is not None else []
    assert main(["runner", "credential", "--runner-dir", str(runner_dir), "--name", NAME, "--hooks-dir",
                 str(root / "hooks"), "--service-config", str(path), *held]) == 0
    token = next(line.split("=", 1)[1] for line in (runner_dir / ".env").read_text().splitlines()
                 if line.startswith("MICROVM_CHECK_RUNNER_TOKEN="))
    with ServiceHost(load_config(path), sandboxes=_no_vms, origin=str(path)) as host:
        yield host, token


def _no_vms(request: Any) -> Any:
    raise AssertionError("no job here gets a checkout: no VM may be created")


def step(host: Any, token: str) -> JobClient:
    """What a step of the runner's job holds: the socket and the credential from its environment."""
    return JobClient(socket=host.config.socket, runner_token=token, retry_statuses=frozenset())


def answer(call: Callable[[], Any]) -> tuple[int, str]:
    """The status of one call (201 for a submit, 200 for anything else answered, 0 for a report the guard
    refused) and its error."""
    try:
        result = call()
    except JobAPIError as exc:
        return exc.status or 0, str(exc)
    if isinstance(result, Verdict):
        return (200 if result.allowed else 0), ""
    return (201 if isinstance(result, JobSummary) else 200), ""


def deliver(host: Any, example: Path, repository: str, run_id: int, runner: str) -> None:
    """GitHub's signed `workflow_job` delivery (the real payload, for job `run_id + 1` of run `run_id` on `runner`)."""
    payload = json.loads(example.read_text())
    payload["workflow_job"].update(id=run_id + 1, run_id=run_id, run_attempt=1, labels=LABELS, name="check",
                                   runner_name=runner)
    payload["repository"]["full_name"] = repository
    body = json.dumps(payload).encode()
    secret = Path(host.config.webhook.secret_path).read_bytes().strip()
    reply = requests.post(f"http://127.0.0.1:{host.webhook.port}/github/webhook", data=body, timeout=30, headers={
        "Content-Type": "application/json", "X-GitHub-Event": "workflow_job", "X-GitHub-Delivery": str(uuid.uuid4()),
        "X-Hub-Signature-256": sign(secret, body)})
    assert reply.status_code == 200 and "ignored" not in reply.json()["message"], reply.text


def jobs_of(host: Any, repository: str) -> list[Any]:
    return [record for record in host.service.list(limit=50) if record.repository.lower() == repository]


def test_without_a_webhook_a_runner_that_ends_its_binding_cannot_claim_another_repository(rig_root: Path) -> None:
    with registered_service(rig_root, webhook=False, repository=OURS) as (host, token), step(host, token) as client:
        assert answer(lambda: client.job_started(started(OURS))) == (200, "")
        own = answer(lambda: client.submit(spec(OURS)))
        client.job_completed()  # the step ends its own binding: on this host the hook's call does
        claim = answer(lambda: client.job_started(started(OTHER, RUN_ID + 1)))
        taken = answer(lambda: client.submit(spec(OTHER, RUN_ID + 1)))
        next_job = answer(lambda: client.job_started(started(OURS, RUN_ID + 2)))  # its own repository's next job
        other_jobs = jobs_of(host, OTHER)
    assert own[0] == 201
    assert claim[0] == 403, claim
    assert (f"runner {NAME} is held to repository {OURS} by its credential (the operator's), but reported "
            f"{OTHER} run {RUN_ID + 1}/1 job check") in claim[1]
    assert taken[0] == 403 and "has not reported a job" in taken[1], taken
    assert next_job == (200, "")
    assert other_jobs == []


def test_without_a_webhook_a_credential_naming_no_repository_takes_no_job(rig_root: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with registered_service(rig_root, webhook=False, repository=None) as (host, token), step(host, token) as client:
        warned = capsys.readouterr().out
        report = answer(lambda: client.job_started(started(OURS)))
        submitted = answer(lambda: client.submit(spec(OURS)))
    assert f"warning: runner {NAME} takes no job" in warned and "--repository OWNER/NAME" in warned
    assert report[0] == 403, report
    assert "this service has no webhook to say which job GitHub gave it" in report[1]
    assert "microvm-check runner credential --repository OWNER/NAME" in report[1]
    assert submitted[0] == 403


def test_with_a_webhook_only_the_run_github_put_on_the_runner_binds_it(rig_root: Path) -> None:
    with registered_service(rig_root, webhook=True, repository=None) as (host, token), step(host, token) as client:
        deliver(host, IN_PROGRESS, OURS, RUN_ID, NAME)
        early = answer(lambda: client.job_started(started(OTHER, RUN_ID + 1)))  # before the runner's own hook
        assert answer(lambda: client.job_started(started(OURS))) == (200, "")
        own = answer(lambda: client.submit(spec(OURS)))
        client.job_completed()  # on a webhook host the hook's call does not end the binding
        claim = answer(lambda: client.job_started(started(OTHER, RUN_ID + 1)))
        taken = answer(lambda: client.submit(spec(OTHER, RUN_ID + 1)))
        # GitHub's `completed` ends the job; a process it left behind still holds the credential
        deliver(host, COMPLETED, OURS, RUN_ID, NAME)
        host.service.access.runners.placement_seconds = 0.5  # no in_progress will come: do not wait 30 s for it
        stale = answer(lambda: client.job_started(started(OURS)))
        leftover = answer(lambda: client.job_started(started(OTHER, RUN_ID + 1)))
        after = answer(lambda: client.submit(spec(OTHER, RUN_ID + 1)))
        other_jobs = jobs_of(host, OTHER)
    assert early[0] == 403 and f"but GitHub says it runs {OURS} run {RUN_ID}/1" in early[1], early
    assert own[0] == 201
    assert claim[0] == 403, claim
    assert f"but GitHub says it runs {OURS} run {RUN_ID}/1" in claim[1]
    assert taken[0] == 403, taken
    assert stale[0] == 403 and f"no signed workflow_job in_progress delivery named runner {NAME}" in stale[1], stale
    assert leftover[0] == 403 and "no signed workflow_job in_progress delivery" in leftover[1], leftover
    assert after[0] == 403 and "has not reported a job" in after[1], after
    assert other_jobs == []


def test_a_report_made_before_githubs_word_waits_for_it_and_one_at_a_time(rig_root: Path) -> None:
    """The runner's hook and GitHub's in_progress delivery come in either order."""
    with registered_service(rig_root, webhook=True, repository=None) as (host, token):
        results: list[tuple[int, str]] = []
        with step(host, token) as first:
            waiting = threading.Thread(target=lambda: results.append(answer(lambda: first.job_started(started(OURS)))))
            waiting.start()
            wait_until(lambda: NAME in host.service.access.runners._waiting or not waiting.is_alive(), 30,
                       "the report to wait (or to be answered without waiting)")
            host.service.access.runners.placement_seconds = 2  # the first report waits its 30 s; any other, 2 at most
            with step(host, token) as second:
                another = answer(lambda: second.job_started(started(OURS)))
            deliver(host, IN_PROGRESS, OURS, RUN_ID, NAME)
            waiting.join(60)
    assert another[0] == 403 and "already has a report waiting for GitHub's word" in another[1], another
    assert results == [(200, "")]


def test_githubs_next_job_on_the_runner_ends_a_binding_whose_completed_never_came(rig_root: Path) -> None:
    with registered_service(rig_root, webhook=True, repository=None) as (host, token), step(host, token) as client:
        deliver(host, IN_PROGRESS, OURS, RUN_ID, NAME)
        assert answer(lambda: client.job_started(started(OURS))) == (200, "")
        submitted = client.submit(spec(OURS))
        assert answer(lambda: client.get(submitted.id)) == (200, "")  # with the job token the submit answered
        deliver(host, IN_PROGRESS, OTHER, RUN_ID + 1, NAME)  # the runner runs OTHER's job now
        old = answer(lambda: client.submit(spec(OURS)))
        reach = answer(lambda: client.get(submitted.id))
        bound = host.desk.runner_job(NAME)
        record = host.service.get(submitted.id)
    assert old[0] == 403 and "has not reported a job" in old[1], old
    assert reach[0] == 403 and "a token that is not this job's" in reach[1], reach
    assert bound is None
    assert record.state.value == "cancelled" and f"GitHub reports runner {NAME} running another job" in record.error


def test_a_late_in_progress_of_a_job_github_said_completed_places_nothing(rig_root: Path) -> None:
    """GitHub sends a failed delivery again later: an in_progress that failed may come after its job's completed."""
    with registered_service(rig_root, webhook=True, repository=None) as (host, token), step(host, token) as client:
        deliver(host, COMPLETED, OTHER, RUN_ID + 1, NAME)
        deliver(host, IN_PROGRESS, OTHER, RUN_ID + 1, NAME)  # the same job, its in_progress redelivered late
        host.service.access.runners.placement_seconds = 0.5  # no in_progress will come: do not wait 30 s for it
        claim = answer(lambda: client.job_started(started(OTHER, RUN_ID + 1)))
    assert claim[0] == 403 and "no signed workflow_job in_progress delivery" in claim[1], claim


def test_a_webhook_host_still_holds_a_runner_to_its_credentials_repository(rig_root: Path) -> None:
    with registered_service(rig_root, webhook=True, repository=OURS) as (host, token), step(host, token) as client:
        deliver(host, IN_PROGRESS, OTHER, RUN_ID + 1, NAME)
        claim = answer(lambda: client.job_started(started(OTHER, RUN_ID + 1)))
    assert claim[0] == 403 and f"runner {NAME} is held to repository {OURS}" in claim[1], claim


def test_a_job_the_fork_guard_refused_submits_nothing(rig_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rules = rig_root / "guard-rules.yml"
    rules.write_text(f"repositories:\n  {OURS}:\n    trusted_triggers: [pull_request_target]\n")
    monkeypatch.setenv("MICROVM_CHECK_GUARD_RULES", str(rules))
    with registered_service(rig_root, webhook=False, repository=OURS) as (host, token), step(host, token) as client:
        verdict = client.job_started(started(OURS))  # a push job: not a trigger this repository trusts
        submitted = answer(lambda: client.submit(spec(OURS)))
    assert not verdict.allowed and "only allows jobs triggered by pull_request_target" in verdict.reasons[0]
    assert submitted[0] == 403, submitted
    assert f"runner {NAME} runs {OURS} run {RUN_ID}/1 job check, which the fork guard did not let run" in submitted[1]


def test_a_fleet_runner_that_ends_its_job_cannot_claim_another_repository(make_rig) -> None:
    """Regression pin: the fleet runner's job-completed call revokes its token, so the claim is not even
    recognised (401)."""
    with make_rig(vms=False, min_idle=1, max_runners=1, shutdown_grace_seconds=0) as rig:
        runner = wait_until(lambda: rig.fleet.runners(), 60, "a runner")[0]
        with JobClient(socket=str(rig.root / "api.sock"), runner_token=runner.token,
                       retry_statuses=frozenset()) as client:
            assert answer(lambda: client.job_started(started(OURS))) == (200, "")
            client.job_completed()
            claim = answer(lambda: client.job_started(started(OTHER, RUN_ID + 1)))
            taken = answer(lambda: client.submit(spec(OTHER, RUN_ID + 1)))
        other_jobs = jobs_of(rig.host, OTHER)
    assert claim[0] == 401 and "not one this service issued" in claim[1], claim
    assert taken[0] == 401, taken
    assert other_jobs == []


def test_config_check_and_doctor_say_what_binds_a_runners_jobs(rig_root: Path, capsys: pytest.CaptureFixture[str],
                                                               ) -> None:
    from runner.cli import main
    from runner.commands import doctor
    from runner.fleet import registered

    state = rig_root / "state"
    (rig_root / "runner").mkdir()
    for name, repository in (("pinned", OURS), ("free", None)):
        registered.issue(state, name, rig_root / "runner", rig_root / "hooks", str(rig_root / "api.sock"), repository)
    plain, hooked = rig_root / "plain.yml", rig_root / "hooked.yml"
    plain.write_text(yaml.safe_dump({"state_dir": str(state), "local_jobs": {"repository": "local/jobs"}}))
    (rig_root / "secret").write_text("s3cret")
    hooked.write_text(yaml.safe_dump({"state_dir": str(state), "webhook": {
        "listen": "127.0.0.1:8471", "secret_path": str(rig_root / "secret"), "labels": LABELS}}))
    capsys.readouterr()
    assert main(["config", "check", str(plain), str(hooked)]) == 0
    out = capsys.readouterr().out
    doctor.cmd_doctor(argparse.Namespace(selftest=False, config=plain))
    said = capsys.readouterr().out
    plain_lines, hooked_lines = out.split(f"ok {hooked}\n")
    assert "repository mode (no webhook): each is held to the repository its credential names" in plain_lines
    assert f"runner binding: registered runner pinned: takes jobs of {OURS} only\n" in plain_lines
    assert "runner binding: registered runner free: takes no job (its credential names no repository)" in plain_lines
    assert "socket members without a credential: local jobs, run as local/jobs" in plain_lines
    assert "webhook mode: bound only to the run GitHub's signed workflow_job in_progress delivery" in hooked_lines
    assert f"registered runner pinned: takes jobs of {OURS} only, as GitHub places them" in hooked_lines
    assert "registered runner free: takes the jobs GitHub places on it" in hooked_lines
    assert "socket members without a credential: may not submit" in hooked_lines
    assert [line for line in said.splitlines() if line.startswith("runner binding:")] == [
        line.strip() for line in plain_lines.splitlines() if line.startswith("  ")]


def test_credential_files_before_and_after_the_repository_line(tmp_path: Path) -> None:
    """A file written before credentials named a repository holds the digest alone: it still loads (and in
    repository mode takes no job); a file whose second line is anything but a repository is no credential."""
    from runner.errors import ConfigError
    from runner.fleet import registered

    store = tmp_path / registered.CREDENTIALS
    store.mkdir()
    digest = "ab" * 32
    (store / "old").write_text(f"{digest}\n")
    (store / "held").write_text(f"{digest}\nrepository ListenDev/LSTN\n")
    (store / "odd").write_text(f"{digest}\nrepository ../etc\n")
    (store / "more").write_text(f"{digest}\nrepository a/b\nrepository c/d\n")
    assert registered.load(tmp_path) == {"old": registered.Credential(bytes.fromhex(digest)),
                                         "held": registered.Credential(bytes.fromhex(digest), OURS)}
    (tmp_path / "runner").mkdir()
    with pytest.raises(ConfigError, match="--repository 'lstn': expected OWNER/NAME"):
        registered.issue(tmp_path, "x", tmp_path / "runner", tmp_path / "hooks", "/run/api.sock", "lstn")
