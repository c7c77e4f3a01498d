"""The service's log notes about artifacts a guest sent: bounded however many it sends, and always
printable, so that artifact trouble stays a warning and the job keeps its command's exit code."""

from __future__ import annotations

import base64
import json
import os
import tarfile

from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.jobs import outputs as job_module
from tests.service.jobs.test_service import run, wait_final
from tests.service.service_fakes import member, tar_of


def system_lines(service, job: str) -> list[str]:
    lines = (service.config.jobs_dir / job / "log.ndjson").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    return [base64.b64decode(e["data"]).decode() for e in entries if e["stream"] == "system"]


def test_skipped_artifacts_get_a_bounded_number_of_notes(make_service, engine: FakeSandboxes) -> None:
    """Each skipped member was a note of up to ~1.5 KiB outside the guest's log budget: 10**6 of them
    (the largest max_count) would have been over a GiB of log on disk for ~1.5 GiB of guest tar."""
    engine.programs["ok"] = prints(b"", 0)
    links = [(member(f"out/l{i}", tarfile.SYMTYPE, "/etc/shadow"), None) for i in range(300)]
    engine.artifacts_tar = tar_of([(member("out/ok"), b"1"), *links])
    service = make_service()
    job = run(service, "ok", artifacts=["out/**"])
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, rec.exit_code, [a.to_wire() for a in rec.artifacts]) == ("finished", 0, [{"path": "out/ok", "size": 1}])
    notes = [line for line in system_lines(service, job) if "artifact" in line]
    skipped = [line for line in notes if line.startswith("warning: artifact out/l")]
    assert len(skipped) == job_module.MAX_ARTIFACT_NOTES
    assert f"warning: {300 - job_module.MAX_ARTIFACT_NOTES} more artifacts skipped" in "\n".join(notes)
    with tarfile.open(service.artifacts_path(job)) as tar:  # the action still learns of every one
        assert len(tar.getnames()) == 301


def test_a_name_that_is_not_utf8_is_a_note_not_a_failed_job(make_service, engine: FakeSandboxes) -> None:
    engine.programs["ok"] = prints(b"", 5)
    engine.artifacts_tar = tar_of([(member(os.fsdecode(b"out/l\xe9nk"), tarfile.SYMTYPE, "x"), None),
                                   (member("out/ok"), b"1")])
    service = make_service()
    job = run(service, "ok", artifacts=["out/**"])
    wait_final(service, job)
    rec = service.get(job)
    assert (rec.state, rec.exit_code, rec.error) == ("finished", 5, None)
    assert "warning: artifact out/l?nk skipped: member 'out/l?nk': the name is not UTF-8" in "\n".join(system_lines(service, job))
