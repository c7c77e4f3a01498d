"""`microvm-check status` and `jobs show | logs | cancel`: through the running service's API on its socket, with
the API's operator checks (root or the admin_group reach every job; anyone else is refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from runner.cli import main
from runner.sandbox.fake import FakeSandboxes, prints, waits
from tests.jobapi.test_restored_from import SOURCE_DIGEST, image_manifest
from tests.service.service_fakes import checkout_tar, spec


def _run(client, command: str) -> str:
    job = client.submit(spec(command)).id
    client.upload_checkout(job, checkout_tar())
    return job


def test_status_works_without_a_fleet(api, engine: FakeSandboxes, tmp_path: Path, capsys) -> None:
    """Before: `status` read the fleet's status file and refused on a host without `runners:`."""
    engine.programs["ok"] = prints(b"fine\n")
    service, client = api()
    list(client.logs(_run(client, "ok")))
    config = tmp_path / "service.yml"
    config.write_text(f"socket: {service.config.socket}\nstate_dir: {service.config.state_dir}\n")
    assert main(["status", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "jobs: 0 running, 0 queued" in out and "VMs: 0 running" in out
    assert "recent jobs (1):" in out and "finished" in out and "exit   0" in out
    assert "runners: none (no runners: section in the config)" in out
    assert main(["status", "--socket", service.config.socket, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"vms", "spare_pools", "queue", "recent_jobs", "fleet", "listening"} and data["fleet"] is None
    assert [j["state"] for j in data["recent_jobs"]] == ["finished"]


def test_jobs_show_logs_and_cancel(api, engine: FakeSandboxes, capfd) -> None:
    release = threading.Event()
    engine.programs.update({"bad": prints(b"oops\n", 3), "wait": waits(release)})
    engine.manifest = image_manifest()
    service, client = api()
    sock = service.config.socket
    failed = _run(client, "bad")
    list(client.logs(failed))
    assert main(["jobs", "show", failed, "--socket", sock]) == 0
    out = capfd.readouterr().out
    assert failed in out and "result failure (exit 3)" in out
    assert f"    restored from node20 (f00d), image docker://127.0.0.1:5000/node@{SOURCE_DIGEST} " in out
    assert main(["jobs", "logs", failed, "--socket", sock]) == 0
    assert "oops" in capfd.readouterr().out
    running = _run(client, "wait")
    for entry in client.logs(running):
        if entry.data == b"started\n":
            break
    # without --follow: what the running job has written so far, then the command ends
    assert main(["jobs", "logs", running, "--socket", sock]) == 0
    assert "started" in capfd.readouterr().out
    # a process of its own: two threads printing through one sys.stdout can lose each other's bytes
    follower = subprocess.Popen([str(Path(sys.executable).parent / "microvm-check"), "jobs", "logs", running,
                                 "--follow", "--socket", sock], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert main(["jobs", "cancel", running, "--socket", sock]) == 0
    assert f"job {running}: cancel" in capfd.readouterr().out
    try:
        follower.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        follower.kill()
        follower.communicate()
        raise AssertionError("--follow did not end with the job") from None
    assert service.get(running).state.value == "cancelled"
    assert main(["jobs", "show", "nosuchjob", "--socket", sock]) == 1
    assert "`microvm-check jobs` lists the ids" in capfd.readouterr().err
    release.set()


def test_others_are_refused_by_the_apis_operator_check(api, engine: FakeSandboxes, short_dir: Path) -> None:
    """A user who may use the socket (its group) but is not the operator reaches no one's job nor the status."""
    engine.programs["ok"] = prints(b"fine\n")
    os.chmod(short_dir, 0o755)
    service, client = api(socket_group="nogroup")
    job = _run(client, "ok")
    list(client.logs(job))
    for argv in (["jobs", "show", job], ["jobs", "cancel", job], ["jobs", "logs", job], ["status"]):
        done = subprocess.run([sys.executable, "-I", "-m", "runner.cli", *argv, "--socket", service.config.socket],
                              user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=60,
                              cwd="/")
        assert done.returncode == 1 and ": 403 " in done.stderr, (argv, done.stderr)
        assert "or by the operator" in done.stderr or "the host's status is for the operator" in done.stderr
    assert service.get(job).state.value == "finished"


def test_status_shows_the_fleets_runners_once_and_its_own_vm_lines(capsys) -> None:
    from runner.commands.status import render

    now = 1000.0
    fleet = {"updated_at": now, "org": "octo-org", "labels": ["microvm"], "max_runners": 2, "min_idle": 1,
             "stopping": False, "runners": [{"name": "mvc-a", "since": now - 30, "job": None}], "pending_jobs": 0,
             "to_deregister": []}
    text = render({"vms": [{"id": "v1", "ready_ms": 40.0, "job": "j1"}], "spare_pools": {"size": 1, "ready": {}},
                   "queue": {"ok": True, "accel": "tcg", "running": 1, "queued": 0, "warm": 0},
                   "recent_jobs": [], "fleet": fleet}, now)
    assert "runners for org octo-org" in text and "mvc-a" in text and "idle" in text
    assert [line for line in text.splitlines() if line.startswith("VMs:")] == \
        ["VMs: 1 running (1 with a job or a sandbox, 0 spare)"]
    assert "  v1  ready in 40.0 ms  job j1" in text
