"""The README's "Operate it" commands, run as written against a real service and a real VM (only the paths
are this test's own; the template build is the one scripts/setup already did, linked in read only)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.vm


def readme_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Operate it: from install to dashboard", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def serving_address(server: subprocess.Popen[str]) -> str:
    """The TCP address `serve` says it listens on, from its start-up line (it bound port 0); the rest of
    its stderr is drained by a thread, so it never blocks on a full pipe."""
    assert server.stderr is not None
    seen = []
    for line in server.stderr:  # ends at EOF if serve exits: then the assert below shows why
        seen.append(line)
        if found := re.search(r"serving jobs on \S+ and (127\.0\.0\.1:\d+)", line):
            threading.Thread(target=server.stderr.read, daemon=True).start()
            return found.group(1)
    raise AssertionError(f"serve never said where it listens: {''.join(seen)[-3000:]}")


@pytest.fixture
def root() -> Path:
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    require(shutil.which("curl") is not None, "curl is not installed")
    require(shutil.which("promtool") is not None, "promtool is not installed (Debian package prometheus)")
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateNotFound, TemplateStore

    try:
        TemplateStore(StateDir.default().templates).get("base")
    except TemplateNotFound as exc:
        require(False, str(exc))
    path = Path(tempfile.mkdtemp(prefix="mvc-readme-", dir="/tmp"))
    (path / "state").mkdir()
    os.symlink(StateDir.default().templates, path / "state" / "templates")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_operator_path_in_the_readme_works_as_written(root: Path) -> None:
    token = root / "api-token"
    token.write_text("readme-operator-token-0123456789\n")
    config = root / "service.yml"
    config.write_text(f"socket: {root}/api.sock\nstate_dir: {root}/state\nlisten: \"127.0.0.1:0\"\n"
                      f"token_file: {token}\nshutdown_grace_seconds: 0\n")
    checkout = root / "co"
    checkout.mkdir()
    (checkout / "README").write_text("hello\n")
    swaps = {"/etc/microvm-check/service.yml": str(config), "/run/microvm-check/api.sock": str(root / "api.sock"),
             "/etc/microvm-check/api-token": str(token), "--dir .": f"--dir {checkout}"}
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    server = None
    outputs: dict[str, str] = {}
    try:
        for line in readme_block():
            for old, new in swaps.items():
                line = line.replace(old, new)
            words = shlex.split(line)
            if words[:3] == ["microvm-check", "template", "build"]:
                continue  # scripts/setup built it; the state_dir links it in
            if line.endswith("&"):
                server = subprocess.Popen(shlex.split(line[:-1]), env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
                swaps["127.0.0.1:8470"] = serving_address(server)  # the port the kernel chose for port 0
                continue
            if "JOB_ID" in line:
                line = line.replace("JOB_ID", re.search(r"^(j[0-9a-f]+)\s", outputs["jobs"], re.M).group(1))
            done = subprocess.run(["bash", "-c", line], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
            key = " ".join(words[1:3]) if words[0] == "microvm-check" and words[1] == "jobs" and \
                not words[2].startswith("-") else words[1] if words[0] == "microvm-check" else words[0]
            outputs[key] = done.stdout
            if key == "doctor":  # other host checks may differ here; what this config uses must pass
                assert f"ok  template 'base' is built in {root}/state" in done.stdout, done.stdout
                assert f"ok  service config {config} is valid" in done.stdout
                continue
            assert done.returncode == 0, (line, done.stdout, done.stderr)
        assert "hello from a VM" in outputs["run"]
        assert "recent jobs (1):" in outputs["status"] and "VMs:" in outputs["status"]
        assert "result success" in outputs["jobs show"]
        assert re.search(r"restored from base \([0-9a-f]+\), (kvm|tcg)\n", outputs["jobs show"]), outputs["jobs show"]
        assert "hello from a VM" in outputs["jobs logs"]
        assert 'microvm_check_jobs_total{result="success",state="finished"} 1.0' in outputs["curl"]
        assert "SUCCESS: 5 rules found" in outputs["promtool"]
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            assert server.wait(120) == 0
