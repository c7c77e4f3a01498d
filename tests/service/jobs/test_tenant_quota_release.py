"""A repository's running quota is given back when its job ends (runner/service/jobs/service.py tells the
queue `finished`): with max_running_per_repository 1, a fleet runner's jobs of one repository run one
after the other, every one of them, instead of the first one's end leaving the repository's only
running place taken for good."""

from __future__ import annotations

import time

from runner.jobapi.contract import ACTIVE_STATES
from runner.sandbox.fake import FakeSandboxes, prints
from tests.service.jobs.test_tenant_quotas import runner
from tests.service.service_fakes import checkout_tar, spec


def test_a_repositorys_jobs_run_one_after_another_under_a_running_quota_of_one(make_service, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"")
    service = make_service(max_queued_jobs=8, max_concurrent_jobs=2, max_running_per_repository=1,
                           max_queued_per_runner=8)
    caller = runner(service, "r1", "octo/one")
    jobs = [service.submit_as(caller, spec("ok", repository="octo/one", run_id=7))[0] for _ in range(3)]
    for job in jobs:
        service.put_checkout(job.id, [checkout_tar()])
    # Each job is a no-op; a quota never given back leaves the rest queued for good. Wait for every job to end,
    # not only to leave "queued"/"running": a job the worker has just taken is "starting" (under load, long enough
    # to be seen), and stopping there made this test fail with a healthy service.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(service.get(job.id).state in ACTIVE_STATES for job in jobs):
        time.sleep(0.05)
    assert [(service.get(job.id).state, service.get(job.id).error) for job in jobs] == [("finished", None)] * 3
