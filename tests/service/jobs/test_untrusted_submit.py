"""Issue 13: hostile job submits are refused before anything is reserved, and no bad record stops
the reaper or a worker. The inputs are the ones the fuzzing run found."""

from __future__ import annotations

import logging
import re
import sqlite3
import threading
import time
from collections.abc import Callable

import pytest

from runner.jobapi.client import JobAPIError
from runner.sandbox.fake import FakeSandboxes, prints, waits
from runner.service.api.refusals import status_of
from runner.service.jobs.admission import InvalidJob
from runner.service.jobs.service import JobService
from tests.service.service_fakes import SHA, checkout_tar, spec

LONE_SURROGATE = "\ud800"  # a lone surrogate: what json.loads makes of "\\ud800"


def eventually(condition: Callable[[], bool], limit: float = 20.0) -> bool:
    """Poll until `condition` holds; False if it never did within `limit` seconds (a hang, not a timing)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def refused(client, fields: dict) -> JobAPIError:
    with pytest.raises(JobAPIError) as err:
        client.submit({**spec("true"), **fields})
    return err.value


@pytest.mark.parametrize("field", ["run_id", "run_attempt"])
def test_a_run_id_beyond_sqlite_is_a_400_and_leaks_no_queue_slot(api, field: str, caplog) -> None:
    service, client = api(max_queued_jobs=4)
    for _ in range(4):  # the old code kept a slot for each: the fifth submit was refused with 429
        err = refused(client, {field: 2**63})
        assert err.status == 400
        assert f"{field}: must be between" in str(err)
    assert client.submit(spec("true", run_id=2**63 - 1)).state == "awaiting_checkout"
    assert len(service.runs.all()) == 1
    assert len(list(service.config.jobs_dir.iterdir())) == 1
    assert not [r for r in caplog.records if r.exc_info]


MALFORMED_TEXT = [
    ({"command": LONE_SURROGATE}, "command: not valid Unicode text"),
    ({"env": {"CI": LONE_SURROGATE}}, "env.CI: not valid Unicode text"),
    ({"sha": "abc" + SHA[3:] + "\n"}, "sha: expected a lowercase hex commit id"),
]


@pytest.mark.parametrize("fields, message", MALFORMED_TEXT)
def test_malformed_text_is_refused_naming_the_field(make_service, fields: dict, message: str) -> None:
    service = make_service(max_queued_jobs=1)
    with pytest.raises(InvalidJob, match=re.escape(message)) as err:
        service.submit({**spec("true"), **fields})
    assert status_of(err.value) == 400
    assert service.runs.all() == [] and list(service.config.jobs_dir.iterdir()) == []


@pytest.mark.parametrize("fields, message", MALFORMED_TEXT)
def test_malformed_text_is_a_400_over_the_api(api, fields: dict, message: str, caplog) -> None:
    """The API may refuse a lone surrogate already while reading the JSON; either way a 400, no traceback."""
    service, client = api(max_queued_jobs=1)
    assert refused(client, fields).status == 400
    assert client.submit(spec("true")).state == "awaiting_checkout"
    assert not [r for r in caplog.records if r.exc_info]


def test_a_submit_whose_record_fails_releases_everything(make_service, monkeypatch) -> None:
    service = make_service(max_queued_jobs=1)

    def full_disk(record) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(service.records, "put", full_disk)
    for _ in range(2):  # the second would be QueueFull if the first had kept its reservation
        with pytest.raises(sqlite3.OperationalError):
            service.submit(spec("ok"))
    assert service.runs.all() == []
    assert list(service.config.jobs_dir.iterdir()) == []
    monkeypatch.undo()
    assert service.submit(spec("ok")).state == "awaiting_checkout"


def test_a_checkout_whose_record_fails_leaves_no_spool_and_can_expire(make_host, monkeypatch) -> None:
    host = make_host(max_queued_jobs=1)
    service = host.service
    job = service.submit(spec("ok")).id
    save = service.records.put

    def refuse_queued(record) -> None:
        if record.state == "queued":
            raise sqlite3.OperationalError("database or disk is full")
        save(record)

    monkeypatch.setattr(service.records, "put", refuse_queued)
    with pytest.raises(sqlite3.OperationalError):
        service.put_checkout(job, [checkout_tar()])
    assert service.get(job).state == "awaiting_checkout"
    assert list((service.config.jobs_dir / job).glob("checkout*")) == []
    host.retention.reap(time.time() + 10**6)  # a job left "queued" in memory but never queued would never expire
    assert service.get(job).state == "failed"


@pytest.fixture
def fast_reaper(monkeypatch) -> None:
    monkeypatch.setattr("runner.service.host.retention._REAP_SECONDS", 0.01)


def _expired(service: JobService, job_id: str) -> None:
    """Make a job's checkout overdue without waiting for it."""
    service.runs.get(job_id).record.created_at -= 10**6


@pytest.mark.parametrize("corrupt", [
    pytest.param(lambda record: setattr(record, "run_id", 2**63), id="run_id-2**63"),
    pytest.param(lambda record: setattr(record, "job_name", LONE_SURROGATE), id="job_name-lone-surrogate"),
])
def test_the_reaper_survives_a_record_that_cannot_be_saved(make_host, fast_reaper, corrupt, caplog) -> None:
    """Validation now keeps these out; should one get in by another way, the reaper logs it and goes on."""
    caplog.set_level(logging.ERROR, "runner.service.jobs.runs")
    host = make_host()
    service = host.service
    bad, good = service.submit(spec("ok")).id, service.submit(spec("ok")).id
    corrupt(service.runs.get(bad).record)
    _expired(service, bad)
    _expired(service, good)
    assert eventually(lambda: service.runs.all() == []), "the reaper stopped: the good job never expired"
    assert service.get(good).state == "failed"
    assert any(f"expiring job {bad} failed" in r.getMessage() and r.exc_info for r in caplog.records)
    later = service.submit(spec("ok")).id  # and it keeps running: a job submitted afterwards expires too
    _expired(service, later)
    assert eventually(lambda: service.runs.get(later) is None)
    assert host.retention._reaper.is_alive()
    assert service.queue.counts() == (0, 0)


def test_a_worker_survives_a_job_whose_record_cannot_be_saved(make_service, engine: FakeSandboxes, caplog) -> None:
    release = threading.Event()
    engine.programs.update({"block": waits(release), "ok": prints(b"")})
    service = make_service(max_concurrent_jobs=1)
    first = service.submit(spec("block", timeout_seconds=600)).id
    service.put_checkout(first, [checkout_tar()])
    bad = service.submit(spec("ok")).id
    service.put_checkout(bad, [checkout_tar()])
    bad_run = service.runs.get(bad)
    bad_run.record.job_name = LONE_SURROGATE  # every later save of its record fails
    release.set()
    after = service.submit(spec("ok")).id
    service.put_checkout(after, [checkout_tar()])
    assert eventually(lambda: service.runs.get(after) is None), "the only worker died: the next job never ran"
    assert service.get(after).state == "finished"
    assert service.runs.get(bad) is None and engine.alive() == []
    assert bad_run.done.is_set()  # cancel() and log followers are not left waiting on it
    assert not (service.config.jobs_dir / bad / "checkout.tar").exists()
    assert any(r.exc_info for r in caplog.records if bad in r.getMessage())


def test_refusals_name_the_field(make_service) -> None:
    service = make_service()
    with pytest.raises(InvalidJob) as err:
        service.submit(spec("true", run_id=2**63))
    assert status_of(err.value) == 400
    assert str(err.value) == "invalid job: run_id: must be between 0 and 9223372036854775807, got 9223372036854775808"


def test_shutdown_ends_every_job_past_a_record_that_cannot_be_saved(make_service, caplog) -> None:
    service = make_service()
    bad, good = service.submit(spec("ok")).id, service.submit(spec("ok")).id
    service.runs.get(bad).record.run_id = 2**63
    service.drain(0)  # used to raise on the bad record and leave the rest (and the warm pool) as they were
    assert service.runs.all() == []
    assert service.get(good).state == "cancelled"
    assert any(f"cancelling job {bad} failed" in r.getMessage() for r in caplog.records)
