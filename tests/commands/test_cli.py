"""The CLI: `run` against a service on a socket, `jobs`, and `serve` started and stopped for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.cli import main
from runner.jobapi.client import JobAPIError, JobClient
from runner.sandbox.fake import FakeSandboxes, prints
from tests.service.service_fakes import baked_template, member, tar_of

ROOT = Path(__file__).resolve().parents[2]


def checkout(tmp_path: Path) -> Path:
    co = tmp_path / "co"
    co.mkdir()
    (co / "main.py").write_text("print(1)\n")
    (co / ".git").mkdir()
    (co / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return co


def test_run_streams_output_copies_artifacts_and_exits_with_the_guest_status(
        api, engine: FakeSandboxes, tmp_path: Path, monkeypatch, capfd) -> None:
    engine.programs["make test"] = prints(b"all good\n", 7)
    engine.artifacts_tar = tar_of([(member("out/report.xml"), b"<r/>")])
    service, _ = api()
    co = checkout(tmp_path)
    monkeypatch.chdir(tmp_path)
    status = main(["run", "--socket", service.config.socket, "--dir", str(co), "--artifacts", "out/*.xml",
                   "--timeout", "30", "--", "make", "test"])
    assert status == 7
    assert "all good" in capfd.readouterr().out
    assert (tmp_path / "artifacts" / "out" / "report.xml").read_bytes() == b"<r/>"
    sbx = engine.created[0]
    assert set(sbx.files) == {"/workspace/main.py"}  # .git stays home
    rec = service.list(1)[0]
    assert (rec.repository, rec.job_name, rec.exit_code) == ("local/co", "local", 7)


def test_run_refuses_a_non_empty_artifacts_dir_before_submitting(api, tmp_path: Path, monkeypatch, capsys) -> None:
    service, _ = api()
    co = checkout(tmp_path)
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "old").write_text("x")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--socket", service.config.socket, "--dir", str(co), "--artifacts", "*", "--", "true"]) == 1
    assert "is not empty" in capsys.readouterr().err
    assert service.list(5) == []


def test_run_refuses_links_out_of_the_checkout(api, tmp_path: Path, capsys) -> None:
    service, _ = api()
    co = checkout(tmp_path)
    os.symlink("/etc/passwd", co / "pw")
    assert main(["run", "--socket", service.config.socket, "--dir", str(co), "--", "true"]) == 1
    assert "points outside the checkout" in capsys.readouterr().err


def test_run_needs_a_command(capsys) -> None:
    assert main(["run", "--"]) == 1
    assert "nothing to run" in capsys.readouterr().err


def test_run_reports_a_refused_job(api, tmp_path: Path, capsys) -> None:
    service, _ = api()
    co = checkout(tmp_path)
    assert main(["run", "--socket", service.config.socket, "--dir", str(co), "--template", "nope", "--", "true"]) == 1
    assert "template: 'nope' is not offered here" in capsys.readouterr().err


def test_jobs_lists_records(api, engine: FakeSandboxes, tmp_path: Path, capsys, monkeypatch) -> None:
    engine.programs["true"] = prints(b"")
    service, _ = api()
    co = checkout(tmp_path)
    monkeypatch.chdir(tmp_path)
    main(["run", "--socket", service.config.socket, "--dir", str(co), "--", "true"])
    capsys.readouterr()
    assert main(["jobs", "--json", "--socket", service.config.socket]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["state"], r["exit_code"]) for r in rows] == [("finished", 0)]
    assert main(["jobs", "--socket", service.config.socket]) == 0
    assert rows[0]["id"] in capsys.readouterr().out


def test_jobs_reads_records_from_the_config(make_config, tmp_path: Path, capsys) -> None:
    config = make_config()
    path = tmp_path / "service.yml"
    path.write_text(f"state_dir: {config.state_dir}\n")
    config.state_dir.mkdir(parents=True)
    assert main(["jobs", "--config", str(path)]) == 0
    assert main(["jobs", "--socket", str(tmp_path / "none.sock")]) == 1
    assert "cannot reach the job service" in capsys.readouterr().err


def test_serve_starts_answers_and_stops_on_sigterm(short_dir: Path) -> None:
    config = short_dir / "service.yml"
    config.write_text(f"socket: {short_dir}/api.sock\nstate_dir: {short_dir}/state\nshutdown_grace_seconds: 5\n")
    baked_template(short_dir / "state")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from runner.cli import main; sys.exit(main(sys.argv[1:]))",
                             "serve", "--config", str(config)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        client = JobClient(socket=str(short_dir / "api.sock"))
        deadline = time.monotonic() + 120  # start-up imports and restores; the machine may be busy
        while True:
            try:
                health = client.health()
                break
            except JobAPIError:
                if proc.poll() is not None:
                    pytest.fail(f"serve exited early: {proc.stderr.read()}")
                if time.monotonic() > deadline:
                    pytest.fail("serve never answered on its socket")
                time.sleep(0.05)
        assert health.ok is True
        assert oct(os.stat(short_dir / "api.sock").st_mode & 0o777) == "0o660"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not (short_dir / "api.sock").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_reports_a_bad_config(tmp_path: Path, capsys) -> None:
    path = tmp_path / "service.yml"
    path.write_text("max_concurrent_jobs: 0\n")
    assert main(["serve", "--config", str(path)]) == 1
    assert f"{path}:1:22: max_concurrent_jobs: must be at least 1, not 0" in capsys.readouterr().err


def test_guest_escape_sequences_are_defused_on_a_terminal(monkeypatch) -> None:
    from runner.jobapi.terminal import show as _show

    leader, follower = os.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stdout", tty)
            _show("stdout", b"ok\x1b]52;c;aGk=\x07 \x1b[2Jdone\n")
        assert os.read(leader, 1024).replace(b"\r\n", b"\n") == b"ok?]52;c;aGk=? ?[2Jdone\n"
    finally:
        os.close(leader)
        os.close(follower)


def test_guest_output_passes_unchanged_to_a_pipe(capfdbinary) -> None:
    from runner.jobapi.terminal import show as _show

    _show("stdout", b"\x1b[1mbold\x1b[0m\n")
    assert capfdbinary.readouterr().out == b"\x1b[1mbold\x1b[0m\n"


def test_serve_refuses_to_start_without_a_template_it_offers(short_dir: Path, capsys, monkeypatch) -> None:
    """Before: serve started and every job failed with "no template named 'big'". Now it names the command."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    config = short_dir / "service.yml"
    config.write_text(f"socket: {short_dir}/api.sock\nstate_dir: {short_dir}/state\ntemplates: [base, big]\n")
    baked_template(short_dir / "state", "base")
    assert main(["serve", "--config", str(config)]) == 1
    assert capsys.readouterr().err == (
        f"microvm-check: {config}: templates: 'big' not built in {short_dir}/state/templates; build it: "
        f"sudo microvm-check template build big --config {config}\n")
    assert not (short_dir / "api.sock").exists()


def test_serve_refuses_to_start_with_a_template_whose_agent_is_older(short_dir: Path, capsys, monkeypatch) -> None:
    """A template baked before its agent had `quiesce` (or any operation the host sends): serve names it and the
    rebuild, rather than starting and failing the first snapshot of a warm base."""
    import json

    from runner.vm.templates import TemplateStore

    monkeypatch.setattr(signal, "signal", lambda *args: None)
    config = short_dir / "service.yml"
    config.write_text(f"socket: {short_dir}/api.sock\nstate_dir: {short_dir}/state\n"
                      "sizes:\n  large: {vcpus: 2, memory_mib: 1024, disk_mib: 3072}\n  huge: {vcpus: 2, memory_mib: 2048}\n")
    for name in ("base", "base.large"):  # base.huge was never built: a size class's template is made on demand
        baked_template(short_dir / "state", name)
        manifest = TemplateStore(short_dir / "state" / "templates").dir_for(name, "d" * 20) / "manifest.json"
        manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "agent_ops"}))
    assert main(["serve", "--config", str(config)]) == 1
    old_agent = "was baked with a guest agent older than this host: its manifest records none of the operations the " \
                "agent answers (agent_ops)"
    assert capsys.readouterr().err == (
        f"microvm-check: {config}: template 'base' ({'d' * 20}) {old_agent}: rebuild it with 'microvm-check "
        f"template build base --config {config}'; template 'base.large' ({'d' * 20}) {old_agent}: rebuild it with "
        f"'microvm-check template build base --size large --config {config}'\n")
    assert not (short_dir / "api.sock").exists()
