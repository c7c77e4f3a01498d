"""The client SDK (microvm_check) against a real `serve` on real VMs, as unprivileged users of the host.

A bot user in the config's `sandboxes.group` creates a sandbox, streams an exec, writes, reads and lists
files, uploads a tar, downloads a checked one, forks a snapshot and destroys; a user who may use the
socket but is outside that group is refused; one sandbox's token opens nothing of another's; a bot
killed with kill -9 in the middle of an exec leaves nothing once its sandbox's TTL has passed, and
its record says so. Needs root, QEMU and the built `base` template: failing under CI=true.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runner.jobapi.client import JobClient
from runner.vm.sweep import processes_under
from tests.e2e.test_vm_e2e_serve import serve  # noqa: F401 (fixture)
from tests.e2e.vm_jobs import templates, vm_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vm
ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
BOT = Path(__file__).resolve().parent / "sdk_bot.py"


@dataclass(frozen=True)
class Users:
    bot: int
    outsider: int
    runner: str  # a runner's user in both groups: runs fork steps on the host, so never creates sandboxes
    socket_group: str
    sandbox_group: str


@pytest.fixture
def users() -> Iterator[Users]:
    """Two users who may use the socket (its group); only the bot is in the sandbox group."""
    tag = secrets.token_hex(3)
    sock_group, sbx_group, bot, outsider, runner = (f"mvcsk{tag}", f"mvcsb{tag}", f"mvcbot{tag}", f"mvcout{tag}",
                                                    f"mvcrun{tag}")
    for group in (sock_group, sbx_group):
        subprocess.run(["groupadd", "--system", group], check=True)
    for user, groups in ((bot, f"{sock_group},{sbx_group}"), (outsider, sock_group),
                         (runner, f"{sock_group},{sbx_group}")):
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--gid", sock_group,
                        "--groups", groups, user], check=True)
    try:
        yield Users(pwd.getpwnam(bot).pw_uid, pwd.getpwnam(outsider).pw_uid, runner, sock_group, sbx_group)
    finally:
        for user in (bot, outsider, runner):
            subprocess.run(["pkill", "-KILL", "-u", user], check=False)
            subprocess.run(["userdel", user], check=False)
        for group in (sock_group, sbx_group):
            subprocess.run(["groupdel", group], check=False)


def run_as(uid: int, argv: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """`argv` as the user `uid` (its groups, as a login would have them), from / with a bare environment."""
    account = pwd.getpwuid(uid)
    return subprocess.run(argv, user=uid, group=account.pw_gid, extra_groups=os.getgrouplist(account.pw_name,
                          account.pw_gid), env={"PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True,
                          timeout=timeout, **kwargs)  # type: ignore[call-overload]


def _run_as(uid: int, socket: Path, args: tuple[str, ...], timeout: float) -> list[dict]:
    done = run_as(uid, [str(PYTHON), "-I", str(BOT), str(socket), *args], timeout)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def facts(lines: list[dict]) -> dict:
    merged: dict = {}
    for line in lines:
        merged.update(line)
    return merged


def test_a_bot_drives_sandboxes_and_others_reach_none(serve, vm_root: Path, users: Users) -> None:
    os.chmod(vm_root, 0o755)  # the users reach the socket in it (the state dir stays the service's)
    service = serve({"socket_group": users.socket_group, "max_concurrent_jobs": 1,
                     "runners": {"runner_user": users.runner},
                     "sandboxes": {"group": users.sandbox_group, "max_ttl_seconds": 600, "max_per_caller": 2}})
    socket = vm_root / "api.sock"
    operator = JobClient(socket=str(socket))
    service.wait_answering(operator)

    refused = facts(_run_as(users.outsider, socket, ("create",), 120))
    assert refused["create"] == 403 and users.sandbox_group in refused["message"], refused
    runner = facts(_run_as(pwd.getpwnam(users.runner).pw_uid, socket, ("create",), 120))
    assert runner["create"] == 403 and "a runner's user" in runner["message"], runner

    seen = facts(_run_as(users.bot, socket, ("tour",), 900))
    assert seen["exit_code"] == 3 and seen["stdout"] == "one\n" and seen["stderr"] == "two\n", seen
    first, last = seen["chunks"][0], seen["chunks"][-1]
    assert first[1:] == ["stdout", "one\n"] and last[1:] == ["stderr", "two\n"] and last[0] >= 1.5, \
        f"the output did not stream as it came: {seen['chunks']}"
    assert seen["read"] == "written by the bot\n"
    assert {"notes.txt", "src", "README.txt"} <= set(seen["listed"]), seen["listed"]
    assert seen["ran"] == 0 and seen["downloaded"] == ["README.txt", "notes.txt", "out.txt"], seen
    assert seen["out"] == "hi\n"
    assert seen["fork_read"] == "written by the bot\n", "the fork does not have its source's files"
    # the template is the template, a fork's its source's (it was the record's command text)
    assert seen["template"] == seen["fork_template"] == "base" and seen["ttl_seconds"] == 300, seen
    assert seen["fork_base"] == f"sbx-{seen['created']}-1", seen
    assert seen["cross"] == 403 and seen["cross_back"] == 403, "one sandbox's token reached another sandbox"
    assert seen["parent_read"] == "written by the bot\n", "a write in the fork reached its source"
    assert seen["after_destroy"] == 404

    records = {r.id: r for r in operator.list(50)}
    for sandbox_id in (seen["created"], seen["forked"]):
        record = records[sandbox_id]
        assert record.state.value == "finished" and record.job_name == "sandbox", record
        assert f"uid {users.bot}" in record.command
    assert records[seen["forked"]].warm, "the fork's record does not say it came from a base"
    for record in (records[seen["created"]], records[seen["forked"]]):
        assert record.vm_id and not (vm_root / "state" / "vms" / record.vm_id).exists(), "a destroyed sandbox's VM is left"
    snapshots = [p.name for p in (vm_root / "state" / "templates").iterdir() if p.name.startswith(f"sbx-{seen['created']}")]
    assert snapshots == [], f"the fork's snapshot outlived both sandboxes: {snapshots}"
    assert service.stop() == 0, service.stderr()


def test_calls_a_sandbox_cannot_make_are_refused_with_the_reason_and_a_begun_exec_ends_with_it(
        serve, vm_root: Path, users: Users) -> None:
    """A guest's (or the host unpacker's) refusal is the caller's 400 with the reason, for the blocking and
    the asyncio SDK alike, and the sandbox lives on; a VM that dies in a call ends its sandbox (404 with
    why), and an exec whose answer had begun ends with an error line the SDK reads. No 500, no broken
    stream, no traceback in the service's log: they were 500 'internal error' and a chunked body cut short."""
    os.chmod(vm_root, 0o755)
    service = serve({"socket_group": users.socket_group, "sandboxes": {"group": users.sandbox_group}})
    service.wait_answering(JobClient(socket=str(vm_root / "api.sock")))
    seen = facts(_run_as(users.bot, vm_root / "api.sock", ("refusals",), 900))
    because = {
        "exec a missing program": "cannot start 'no-such-program': No such file or directory",
        "write into a missing directory": "No such file or directory",
        "write 32 MiB into a missing directory": "No such file or directory",
        "write onto a directory": "Is a directory",
        "write a 4096-character path": "File name too long",
        "read a missing file": "No such file or directory",
        "read a directory": "Is a directory",
        "upload a tar the host's unpacker refuses": "cannot unpack the tar stream into /workspace: member 'pipe': a fifo",
    }
    for sdk in ("sync", "async_"):
        assert set(seen[sdk]) == set(because), seen[sdk]
        for what, reason in because.items():
            answer = seen[sdk][what]
            assert answer["status"] == 400 and reason in answer["message"], (sdk, what, answer)
    assert seen["alive"] == [0, "alive\n"], "a refused call ended the sandbox"
    assert seen["mid_stream"]["status"] is None, seen["mid_stream"]
    assert seen["mid_stream"]["message"].startswith("exec: sandbox j") and "has ended: its VM failed" in \
        seen["mid_stream"]["message"], seen["mid_stream"]
    assert seen["before_output"]["status"] == 404 and "has ended: its VM failed" in seen["before_output"]["message"], \
        seen["before_output"]
    assert service.stop() == 0, service.stderr()
    assert "Traceback" not in service.stderr(), service.stderr()


@pytest.fixture
def bot_dir(users: Users) -> Iterator[Path]:
    """A directory of the bot's own, which it can reach (pytest's tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="mvc-sdk-bot-"))
    os.chown(base, users.bot, -1)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def test_a_guest_that_takes_its_agent_over_cannot_make_a_download_write_outside_the_bots_directory(
        serve, vm_root: Path, users: Users, bot_dir: Path) -> None:
    """Root in the guest takes the agent's channel over and answers `download` with members named by an
    absolute path and by '..', whole and then cut short: each tar the bot gets, unpacked with plain
    tarfile into an empty directory, writes nothing outside it. Before, their notes carried those names:
    the bot's victim.txt was truncated, ../victim2.txt and ../glob-escape.txt made beside it."""
    os.chmod(vm_root, 0o755)
    base = bot_dir
    (base / "victim.txt").write_bytes(b"precious\n")
    os.chown(base / "victim.txt", users.bot, -1)
    service = serve({"socket_group": users.socket_group, "sandboxes": {"group": users.sandbox_group}})
    service.wait_answering(JobClient(socket=str(vm_root / "api.sock")))
    seen = facts(_run_as(users.bot, vm_root / "api.sock", ("takeover", str(base)), 900))
    assert seen["takeover"] == [0, ""], "the guest did not take its agent over"
    assert (base / "victim.txt").read_bytes() == b"precious\n", "a file outside the destination was truncated"
    assert sorted(p.name for p in base.iterdir()) == ["dest1", "dest2", "victim.txt"], \
        "a file was made outside the destination"
    refused = {str(base / "victim.txt"): "absolute path", "../victim2.txt": "'..'"}
    ended = "the artifact transfer ended early: the stream ended inside the data of a member"
    for n, also in ((1, {}), (2, {"*": ended, "../glob-escape.txt": ended})):
        assert seen[f"unpacked{n}"] is True, seen
        members = seen[f"members{n}"]
        assert set(members) == {"good.txt", *(f".microvm-check-skipped/{k}" for k in range(1, 3 + len(also)))}, members
        notes = {m["MICROVM_CHECK.skipped_name"]: m["MICROVM_CHECK.skipped"] for m in members.values() if m}
        assert set(notes) == {*refused, *also} and all(why in notes[name] for name, why in {**refused, **also}.items()), \
            notes
        assert (base / f"dest{n}" / "good.txt").read_bytes() == b"fine\n"
    assert service.stop() == 0, service.stderr()


def test_a_killed_bot_leaks_nothing_past_the_ttl(serve, vm_root: Path, users: Users) -> None:
    os.chmod(vm_root, 0o755)
    service = serve({"socket_group": users.socket_group, "sandboxes": {"group": users.sandbox_group}})
    socket = vm_root / "api.sock"
    operator = JobClient(socket=str(socket))
    service.wait_answering(operator)
    account = pwd.getpwuid(users.bot)
    proc = subprocess.Popen([str(PYTHON), "-I", str(BOT), str(socket), "hang", "20"], user=users.bot,
                            group=account.pw_gid, extra_groups=os.getgrouplist(account.pw_name, account.pw_gid),
                            env={"PATH": "/usr/bin:/bin"}, cwd="/", stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        created = json.loads(proc.stdout.readline())
        assert json.loads(proc.stdout.readline()) == {"output": "started\n"}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    vms = vm_root / "state" / "vms"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and operator.get(created["created"]).state.value == "running":
        time.sleep(0.5)
    record = operator.get(created["created"])
    assert record.state.value == "timed_out" and "TTL" in (record.error or ""), record
    assert not (vms / created["vm_id"]).exists(), "the sandbox's VM directory is still there"
    assert processes_under(vms / created["vm_id"]) == [], "the sandbox's QEMU still runs"
    assert service.stop() == 0, service.stderr()


def test_a_snapshot_the_host_cannot_make_is_a_503_and_the_sandbox_lives_on(serve, vm_root: Path) -> None:
    """A snapshot the host fails to make while the VM lives (here: the store's place for it is taken by a
    file; a migration timing out on a busy host is the usual case) was a 500 with a traceback, and still
    counted against the sandbox's max_snapshots. It is a 503 saying why and to retry; the next one works."""
    from microvm_check import Sandbox, SandboxError

    service = serve({})
    socket = vm_root / "api.sock"
    service.wait_answering(JobClient(socket=str(socket)))
    with Sandbox.create(ttl_seconds=600, socket=str(socket)) as sbx:
        blocker = vm_root / "state" / "templates" / f"sbx-{sbx.id}-1"
        blocker.write_text("not a template directory\n")
        try:
            with pytest.raises(SandboxError) as failed:
                sbx.snapshot()
        finally:
            blocker.unlink()
        assert failed.value.status == 503 and "failed on the host" in str(failed.value), failed.value
        assert sbx.exec(["echo", "alive"]).stdout == b"alive\n"
        with Sandbox.create(base=sbx.snapshot(), ttl_seconds=600, socket=str(socket)) as fork:
            assert fork.exec(["echo", "forked"]).stdout == b"forked\n"
        sbx.snapshot()  # max_snapshots is 2: the failed one did not count
    assert service.stop() == 0, service.stderr()
    # (the test's blocker, a file where a template directory goes, is logged when the service fails to
    # remove it as the failed snapshot's leftovers: that traceback is the blocker's, not a 500's)
    assert "api: POST" not in service.stderr(), service.stderr()


def readme_sdk_example() -> str:
    section = (ROOT / "README.md").read_text().split("## The SDK: sandboxes for review bots and audit agents", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_sdk_example_runs(serve, vm_root: Path) -> None:
    """The README's SDK block, as written, against a real serve (run by root: the operator may create)."""
    service = serve({})
    socket = vm_root / "api.sock"
    service.wait_answering(JobClient(socket=str(socket)))
    done = subprocess.run([str(PYTHON), "-I", "-c", readme_sdk_example()], env={"MICROVM_CHECK_SOCKET": str(socket),
                          "PATH": "/usr/bin:/bin"}, cwd="/", capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "checked" and lines[1].startswith("3 ") and lines[1].endswith(" False"), lines
    assert lines[2] == "b'import sys'" and lines[3] == "['check.py']", lines
    assert service.stop() == 0, service.stderr()


def readme_embedding_example() -> str:
    section = (ROOT / "README.md").read_text().split("the in-process\n`runner.sandbox.Sandbox`", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_embedding_example_runs(vm_root: Path, tmp_path: Path) -> None:
    """The README's in-process block, as written, on an engine of its own (MICROVM_CHECK_STATE names it, as
    StateDir.default() reads it), run from a directory holding the `./my-project` it copies in."""
    project = tmp_path / "my-project"
    project.mkdir()
    (project / "test_ok.py").write_text("import unittest\n\nclass T(unittest.TestCase):\n"
                                        "    def test_ok(self):\n        self.assertTrue(True)\n")
    done = subprocess.run([str(PYTHON), "-I", "-c", readme_embedding_example()],
                          env={"MICROVM_CHECK_STATE": str(vm_root / "state"), "PATH": "/usr/bin:/bin"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "test_ok (test_ok.T" in done.stdout and done.stdout.splitlines()[-1].startswith("0 "), done.stdout
