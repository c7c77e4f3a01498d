"""The examples/ bots, run as written by an unprivileged user in the sandbox group against a real `serve`
on real VMs. Needs root, QEMU and the built `base` template: failing under CI=true."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_vm_e2e import templates, vm_root  # noqa: F401 (fixtures)
from test_vm_e2e_serve import serve  # noqa: F401 (fixture)
from test_vm_sdk import PYTHON, ROOT, Users, run_as, users  # noqa: F401 (fixture)

from runner.jobapi.client import JobClient

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
