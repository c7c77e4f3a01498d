"""Every field of the submit-vs-reported comparison (runner/service/jobs/auth.py, Access.admit_submit) counts.

A runner's hook reported repository, run, attempt and job; a submit that differs in any one of them is
refused (403), however the others match, so a job cannot borrow the binding of a sibling job of the
same run (another `job_name`) or of a re-run (another `run_attempt`). Repository names are compared
case-insensitively, as GitHub treats them: the same repository in other letters gets in.

The submits are answered as they are, never retried: were a wrongly admitted submit to fill the
runner's queue share, the next one's 429 would otherwise be waited out, and the test would end at a
timeout instead of at the refusal it checks.
"""

from __future__ import annotations

from typing import Any

from runner.jobapi.client import JobAPIError, JobClient
from runner.jobapi.contract import GitHubJob, JobStarted
from tests.fleet.test_fleet import wait_until
from tests.fleet.test_fleet_access import RUN_ID, WORKFLOW

REPORTED = "ListenDev/lstn"  # what the hook reports, in GitHub's own letters


def submit(client: JobClient, repository: str = REPORTED, attempt: int = 1, job: str = "check") -> dict[str, Any]:
    """The service's answer to one submit with the runner's token, not retried."""
    try:
        summary = client.submit({"repository": repository, "sha": "f" * 40, "run_id": RUN_ID, "run_attempt": attempt,
                                 "job_name": job, "command": "true"})
    except JobAPIError as exc:
        return {"status": exc.status, "error": str(exc)}
    return {"status": 201, "id": summary.id}


def test_a_submit_differing_only_in_job_or_attempt_is_refused_and_letter_case_is_not_a_difference(make_rig) -> None:
    with make_rig(vms=False, min_idle=1, max_runners=1, shutdown_grace_seconds=0) as rig:
        runner = wait_until(lambda: rig.fleet.runners(), 60, "a runner")[0]
        socket = rig.root / "api.sock"
        with JobClient(socket=str(socket), runner_token=runner.token, retry_statuses=frozenset()) as client:
            assert client.job_started(JobStarted(
                GitHubJob(REPORTED, RUN_ID, 1, "check"), f"{REPORTED}/{WORKFLOW}@refs/heads/main", "push",
                {"event_name": "push", "repository": REPORTED, "workflow_ref": "", "pull_request": None})).allowed
            deploy, attempt = submit(client, job="deploy"), submit(client, attempt=2)
            lower, upper = submit(client, "listendev/LSTN"), submit(client, "LISTENDEV/LSTN")
        jobs = [rig.host.service.get(answer["id"]) for answer in (lower, upper) if answer["status"] == 201]
    assert deploy["status"] == 403, deploy
    assert (f"runner {runner.name} runs {REPORTED} run {RUN_ID}/1 job check, but this submit is for "
            f"{REPORTED} run {RUN_ID}/1 job deploy") in deploy["error"]
    assert attempt["status"] == 403, attempt
    assert f"but this submit is for {REPORTED} run {RUN_ID}/2 job check" in attempt["error"]
    assert lower["status"] == 201 and upper["status"] == 201, (lower, upper)
    assert [job.repository.lower() for job in jobs] == ["listendev/lstn"] * 2
