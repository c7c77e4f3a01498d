"""The service log: job lifecycle events at INFO, one line each with the job id, as JSON on request."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runner.cli import build_parser
from runner.logs import TextFormatter, setup
from runner.sandbox.fake import FakeSandboxes, prints
from runner.service.config.reading import ConfigError, load_config
from runner.service.jobs.service import JobService
from tests.service.service_fakes import checkout_tar, spec


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_jobs_lifecycle_is_one_json_line_per_event_with_its_job_id(
        make_service: Callable[..., JobService], engine: FakeSandboxes, capsys, restore_logging) -> None:
    engine.programs["ok"] = prints(b"fine\n", 3)
    service = make_service()
    setup("info", "json")  # what `serve` does with its default level and --log-format json

    job = service.submit(spec("ok")).id
    service.put_checkout(job, [checkout_tar()])
    for _ in service.log_of(job).follow():
        pass

    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    events = [line for line in lines if line["logger"] == "runner.jobs"]
    assert [e["event"] for e in events] == ["submitted", "queued", "vm_ready", "started", "vm_destroyed", "finished"]
    assert {e["job_id"] for e in events} == {job} and {e["level"] for e in events} == {"INFO"}
    vm = engine.created[0].id
    assert events[0]["message"] == f"job {job} submitted: octo/hello@{spec()['sha'][:12]} test"
    assert events[2]["vm_id"] == vm and events[4]["message"] == f"job {job} VM {vm} destroyed"
    assert (events[5]["message"], events[5]["state"], events[5]["exit_code"]) == (
        f"job {job} finished: exit code 3", "finished", 3)
    assert all(e["time"].endswith("Z") for e in events)


def test_the_text_format_keeps_one_record_on_one_line() -> None:
    record = logging.LogRecord("runner.jobs", logging.INFO, __file__, 1, "job j1 failed: a\nforged line\x1b[2J", None,
                               None)
    assert TextFormatter().format(record).endswith("runner.jobs INFO job j1 failed: a\\x0aforged line\\x1b[2J")


def test_log_settings_in_the_config_and_on_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "service.yml"
    path.write_text("log_format: json\nlog_level: debug\n")
    config = load_config(path)
    assert (config.log_format, config.log_level) == ("json", "debug")
    path.write_text("log_format: yaml\n")
    with pytest.raises(ConfigError, match=r"service.yml:1:13: log_format: 'yaml' does not fit: the service log's "
                                          r"format: text, or json"):
        load_config(path)
    args = build_parser().parse_args(["serve", "--config", str(path), "--log-format", "json"])
    assert args.log_format == "json"
