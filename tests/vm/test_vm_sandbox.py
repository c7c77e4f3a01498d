"""The Sandbox API on real VMs restored from the built template."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest

from runner.sandbox import Sandbox, SandboxError


def test_output_streams_in_order_and_exit_code_is_a_result(sandbox):
    seen: list[tuple[str, bytes]] = []
    script = "for i in 1 2 3; do echo out$i; sleep 0.2; echo err$i >&2; sleep 0.2; done; exit 3"
    r = sandbox.exec(script, on_output=lambda stream, data: seen.append((stream, data)))
    assert r.exit_code == 3 and not r.timed_out
    assert r.stdout == b"out1\nout2\nout3\n"
    assert r.stderr == b"err1\nerr2\nerr3\n"
    lines = [(s, line) for s, d in seen for line in d.decode().split()]
    expected = [(stream, f"{prefix}{i}") for i in (1, 2, 3) for stream, prefix in (("stdout", "out"), ("stderr", "err"))]
    assert lines == expected


def test_output_arrives_while_the_command_still_runs(sandbox):
    """The command waits for a file that the host writes only once it has seen the first line: it can
    end only if that line arrived while it ran (output held back to the end would time it out)."""
    seen: list[bytes] = []

    def on_output(stream: str, data: bytes) -> None:
        seen.append(data)
        if b"first" in data:
            sandbox.files.write("/tmp/go", b"go")

    r = sandbox.exec("echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second",
                     on_output=on_output, timeout_seconds=60)
    assert not r.timed_out and r.exit_code == 0
    assert b"".join(seen) == b"first\nsecond\n"


@pytest.mark.parametrize("code", [0, 1, 42, 255])
def test_exit_codes(sandbox, code):
    assert sandbox.exec(f"exit {code}").exit_code == code


def test_killed_by_signal_reports_128_plus_signal(sandbox):
    assert sandbox.exec("kill -9 $$").exit_code == 128 + 9


def test_argv_runs_without_a_shell(sandbox):
    r = sandbox.exec(["printf", "%s|", "a b", "$HOME"])
    assert r.stdout == b"a b|$HOME|"


def test_env_cwd_and_user(sandbox):
    r = sandbox.exec("echo $GREETING; pwd; id -un", env={"GREETING": "hello"}, cwd="/tmp", user="runner")
    assert r.stdout.decode().split() == ["hello", "/tmp", "runner"]


# The command's own ids, its session (sid) and pid, its cgroup, and the agent's (PID 1's child that runs
# agent.py). The template has no ps: /proc it is, with builtins and one grep (a fork costs under TCG).
WHO = ("id; read -r _ _ _ _ _ sid _ < /proc/$$/stat; echo $sid $$; cat /proc/self/cgroup; "
       "agent=$(grep -lzxE '/opt/microvm-check/agent[.]py' /proc/[0-9]*/cmdline | grep -vx /proc/1/cmdline); "
       "cat ${agent%cmdline}cgroup")


@pytest.mark.parametrize("user", ["root", "runner"])
def test_a_command_has_its_users_ids_a_session_and_a_cgroup_of_its_own(sandbox, user):
    """uid, gid and every group the guest's own `id USER` names; a session it leads (what setsid gave the
    timeout's kill); a cgroup of its own (what cgroup.kill ends), which the agent that started it has left."""
    expected = sandbox.exec(["id", user]).stdout.decode().strip()
    first = sandbox.exec(WHO, user=None if user == "root" else user).stdout.decode().splitlines()
    second = sandbox.exec(WHO, user=None if user == "root" else user).stdout.decode().splitlines()
    for ids, session, cgroup, agent in (first, second):
        assert ids == expected
        sid, pid = session.split()
        assert sid == pid, "the command does not lead a session of its own"
        assert cgroup.startswith("0::/mvc/") and agent == "0::/", (cgroup, agent)
    assert first[2] != second[2], "two commands shared a cgroup"


def test_host_environment_does_not_leak(sandbox, monkeypatch):
    monkeypatch.setenv("MICROVM_SECRET_TOKEN", "do-not-leak")
    r = sandbox.exec("env")
    assert b"do-not-leak" not in r.stdout


def test_timeout_kills_the_whole_process_tree(sandbox):
    r = sandbox.exec("sleep 300 & setsid sleep 301 & sh -c 'sleep 302' & sleep 303", timeout_seconds=2)
    assert r.timed_out and r.exit_code == 124  # ended by its timeout, not by `sleep 303`
    # every process's arguments, one by one (the template has no ps); this shell's and grep's are longer
    left = sandbox.exec("grep -lzxE '30[0-3]' /proc/[0-9]*/cmdline | wc -l")  # an argument 300-303: those sleeps
    assert left.stdout.strip() == b"0", "processes of the timed-out command survived"


def test_cancel_kills_running_command(sandbox):
    import threading

    result: dict = {}
    running = threading.Event()  # set by the command's own output: cancel only once it runs
    t = threading.Thread(target=lambda: result.setdefault(
        "r", sandbox.exec("echo running; sleep 120", on_output=lambda s, d: running.set())))
    t.start()
    assert running.wait(120), "the command never started"
    sandbox.cancel()
    t.join(timeout=20)
    assert not t.is_alive()
    assert result["r"].exit_code == 128 + 9


def test_files_in_and_out_byte_exact_50mib(sandbox):
    data = os.urandom(50 * 1024 * 1024)
    sandbox.files.write("/tmp/big.bin", data)
    r = sandbox.exec("sha256sum /tmp/big.bin")
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert sandbox.files.read("/tmp/big.bin") == data


def test_copy_in_and_out_directories(sandbox, tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "deep").mkdir(parents=True)
    files = {"a.txt": b"alpha\n", "pkg/b.bin": bytes(range(256)) * 100, "pkg/deep/c": b""}
    for name, content in files.items():
        (src / name).write_bytes(content)
    (src / "run.sh").write_bytes(b"#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    sandbox.copy_in(src, "/workspace/proj")
    assert sandbox.exec("./run.sh", cwd="/workspace/proj").stdout == b"ran\n"
    sandbox.exec("mkdir -p /workspace/proj/out && cp pkg/b.bin out/ && ln -s /etc/passwd out/link", cwd="/workspace/proj")
    dest = tmp_path / "dest"
    dest.mkdir()
    report = sandbox.copy_out("/workspace/proj", dest)
    for name, content in files.items():
        assert (dest / "proj" / name).read_bytes() == content
    assert (dest / "proj" / "out" / "b.bin").read_bytes() == files["pkg/b.bin"]
    assert not (dest / "proj" / "out" / "link").exists(), "a guest symlink was recreated on the host"
    assert "proj/out/link" in [name for name, why in report.skipped]


def test_a_chatty_background_process_sends_nothing_after_its_exec_ended(sandbox):
    """`server &` keeps the exec's pipes: its later output must not reach the host, which counts
    frames for finished requests against a bound and destroys the VM past it."""
    r = sandbox.exec("touch /tmp/ticks; (while true; do echo tick; echo tick >> /tmp/ticks; sleep 0.02; done) &")
    assert r.exit_code == 0
    # Wait, in the guest, for 20 more ticks after that exec ended; frames for it would have come
    # down the channel before this exec's reply, so the count below includes them.
    waited = sandbox.exec("n=$(wc -l < /tmp/ticks); while [ $(wc -l < /tmp/ticks) -lt $((n + 20)) ]; do sleep 0.02; done",
                          timeout_seconds=120)
    assert not waited.timed_out and waited.exit_code == 0
    assert sandbox._vm.agent.channel._stray == 0
    assert sandbox.exec("echo still-here").stdout == b"still-here\n"


def test_read_of_missing_file_is_a_clear_error_and_the_sandbox_survives(sandbox):
    with pytest.raises(SandboxError, match="No such file"):
        sandbox.files.read("/nope")
    assert sandbox.exec("true").exit_code == 0


# With `docker` the container engine runs in the snapshot: its daemon must see the restored clock and
# draw its IDs (crypto/rand) from the reseeded RNG too, not from the state it was frozen with.
ENGINE_VIEW = {"base": "", "docker": "; date -d \"$(docker info -f '{{.SystemTime}}')\" +%s.%N"
                                     "; docker network create n >/dev/null && docker network inspect -f '{{.Id}}' n"}


@pytest.mark.parametrize("template", ["base", "docker"])
def test_two_restores_differ_in_randomness_and_follow_the_host_clock(template, template_store, engine):
    from tests.vm.conftest import require_template

    require_template(template_store, template)
    seen = []
    for n in range(2):
        with Sandbox.create(template=template, engine=engine, job_id=f"clone-{n}") as sbx:
            before = time.time()
            r = sbx.exec("head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s.%N; hostname"
                         + ENGINE_VIEW[template], timeout_seconds=300)
            after = time.time()
            random_hex, guest_time, hostname, *daemon = r.stdout.decode().split()
            # The guest read its clock during the exec: within it, give or take 0.5 s of clock skew,
            # however slow the exec (TCG) was.
            assert before - 0.5 <= float(guest_time) <= after + 0.5, (before, guest_time, after)
            assert hostname == f"clone-{n}"
            assert r.exit_code == 0, r.stderr
            if daemon:
                daemon_time, network_id = daemon
                assert before - 0.5 <= float(daemon_time) <= after + 0.5, (before, daemon_time, after)
                random_hex += network_id
            seen.append(random_hex)
    assert seen[0] != seen[1]
    if template == "docker":
        assert seen[0][64:] != seen[1][64:] and len(seen[0]) == 128, seen


def test_a_pool_miss_sends_the_identity_once(make_engine, monkeypatch):
    from runner.vm.agent import AgentClient

    sent: list[str] = []
    original = AgentClient.identity
    monkeypatch.setattr(AgentClient, "identity", lambda self, hostname, **kw: (sent.append(hostname), original(self, hostname, **kw))[1])
    with Sandbox.create(engine=make_engine(pool_size=0), job_id="miss") as sbx:
        assert sbx.exec("hostname").stdout == b"miss\n"
    assert sent == ["miss"]


def test_a_file_written_in_one_vm_is_absent_from_the_next(engine):
    with Sandbox.create(engine=engine) as first:
        first.exec("echo secret > /workspace/left-behind; echo x > /root/also; sync")
    with Sandbox.create(engine=engine) as second:
        r = second.exec("ls /workspace/left-behind /root/also")
        assert r.exit_code != 0


def test_no_network_card_without_network(sandbox):
    r = sandbox.exec("ls /sys/class/net")
    assert r.stdout.split() == [b"lo"]


def test_kill_9_of_qemu_mid_exec_is_a_clear_error(engine):
    sbx = Sandbox.create(engine=engine)
    vm = engine.live()[0]

    killed: list[int] = []

    def kill_once_running(stream: str, data: bytes) -> None:  # mid-exec for sure, however slow its start
        if not killed:
            killed.append(vm.machine.pid)
            os.kill(vm.machine.pid, signal.SIGKILL)

    with pytest.raises(SandboxError, match="signal 9"):
        sbx.exec("echo running; sleep 60", on_output=kill_once_running)
    assert not sbx.alive
    with pytest.raises(SandboxError, match="signal 9"):
        sbx.exec("true")
    sbx.destroy()  # idempotent


def test_ttl_expiry_destroys_the_vm(engine):
    sbx = Sandbox.create(engine=engine, ttl_seconds=2)
    with pytest.raises(SandboxError, match="TTL"):
        sbx.exec("sleep 30")
    assert not sbx.alive


def test_resources_must_match_the_template(engine):
    with pytest.raises(SandboxError, match="MiB of memory"):
        Sandbox.create(engine=engine, memory_mib=64)
    with pytest.raises(SandboxError, match="vCPU"):
        Sandbox.create(engine=engine, vcpus=7)


def test_unknown_template_says_how_to_build_it(engine):
    with pytest.raises(SandboxError, match="template build nope"):
        Sandbox.create(engine=engine, template="nope")


def test_put_tar_keeps_links_and_modes_and_reports_a_broken_stream(sandbox, tmp_path):
    src = tmp_path / "src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "tool").write_bytes(b"#!/bin/sh\necho tool\n")
    (src / "bin" / "tool").chmod(0o755)
    (src / "current").symlink_to("bin")
    sandbox.copy_in(src, "/workspace/t")
    r = sandbox.exec("./current/tool && stat -c '%U %a' bin/tool && readlink current", cwd="/workspace/t")
    assert r.stdout == b"tool\nroot 755\nbin\n"
    with pytest.raises(SandboxError, match="cannot unpack"):
        sandbox.put_tar([b"this is not a tar stream" * 100], "/workspace/bad")
    assert sandbox.exec("true").exit_code == 0


def test_machines_made_by_one_thread_can_be_killed_by_another_while_it_works(engine):
    """Pool fillers restore VMs that job threads destroy: one machine's QMP must never borrow another's
    event loop, or killing it fails ('This event loop is already running')."""
    import threading

    snapshot = engine.template("base").snapshot(False)
    made: dict = {}
    busy = threading.Event()  # the filler has talked to its second VM many times: it is working
    stop = threading.Event()

    def filler() -> None:
        made["first"], made["second"] = engine._spawn(snapshot), engine._spawn(snapshot)
        made["first"].machine.qmp("query-status")  # both now have QMP sessions made in this thread
        calls = 0
        while not stop.is_set():
            made["second"].machine.qmp("query-status")
            calls += 1
            if calls == 20:
                busy.set()

    thread = threading.Thread(target=filler)
    thread.start()
    try:
        assert busy.wait(120)
        made["first"].destroy()  # from this thread, while the filler keeps talking to its other VM
    finally:
        stop.set()
        thread.join()
        for vm in made.values():
            vm.destroy()


class _FakeVM:
    destroyed = False
    slot = None

    def __init__(self, agent) -> None:
        self.agent = agent


class _TarSendingAgent:
    """Plays the guest's side of get_tar: writes `size` bytes to the host's pipe."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_tar(self, paths, cwd, out, max_bytes, timeout) -> int:
        block = b"\0" * 65536
        for _ in range(self.size // len(block)):
            out.write(block)
        return self.size


def test_copy_out_into_a_missing_directory_is_a_clear_error(tmp_path):
    sbx = Sandbox(engine=None, vm=_FakeVM(_TarSendingAgent(8 * 1024 * 1024)))
    with pytest.raises(SandboxError, match="could not copy /workspace/out into"):
        sbx.copy_out("/workspace/out", tmp_path / "missing")
