"""Runners walled off from each other (runner/fleet/walls.py): two jobs on two stand-in runners at once,
`runners.network: none`. The first leaves what a job could leave for another: files in /tmp, /var/tmp,
/dev/shm and /run/lock, a POSIX message queue in /dev/mqueue, a System V shared memory segment, a
listening abstract Unix socket and a process whose command line holds a secret; the second, running
meanwhile, looks for each. The first job's own look at the same things (all there) shows that the probes
find what exists. Then one runner after another on the same uid: what a job leaves under its uid (a
queue, a kernel key) is not there for the next."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

from runner import uidrange
from runner.fleet import walls, workdir
from runner.fleet.workdir import RunnerUser
from tests.fleet.conftest import Account
from tests.fleet.test_fleet import wait_until

SECRET = "mvc-wall-cmdline-secret"
PLACES = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
LOOK = r'''
import json, os, socket, sys
exchange, places, secret = sys.argv[1], sys.argv[2].split(","), sys.argv[3] + "-secret"  # not in our own argv
seen = {place: os.path.exists(f"{place}/mvc-wall-a") for place in places}
seen["mqueue"] = os.path.exists("/dev/mqueue/mvc-wall-a")
shmid = open(f"{exchange}/ipc-a").read().split()[-1]
seen["sysv"] = any(line.split()[1] == shmid for line in open("/proc/sysvipc/shm").read().splitlines()[1:])
probe = socket.socket(socket.AF_UNIX)
try:
    probe.connect("\0mvc-wall-a")
    seen["abstract"] = True
except OSError:
    seen["abstract"] = False
cmdlines = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read())
    except OSError:
        pass
seen["cmdline"] = any(secret.encode() in line for line in cmdlines)
print("seen " + json.dumps(seen))
'''
LEAVE = '''set -e
for place in {places}; do echo left > "$place/mvc-wall-a"; done
touch /dev/mqueue/mvc-wall-a
ipcmk -M 4096 -p 0644 > {x}/ipc-a.part && chmod 644 {x}/ipc-a.part && mv {x}/ipc-a.part {x}/ipc-a
/usr/bin/python3 -c 'import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind("\\0mvc-wall-a"); s.listen(); \
open(sys.argv[1], "w").close(); time.sleep(600)' {x}/a-listens >/dev/null 2>&1 </dev/null &
sh -c 'sleep 600' {secret} >/dev/null 2>&1 </dev/null &
n=0  # until the socket listens and the secret's process has its command line (a loaded machine takes seconds)
until [ -e {x}/a-listens ] && pgrep -f -- {secret} >/dev/null; do n=$((n + 1)); [ $n -lt 600 ] || break; sleep 0.05; done
/usr/bin/python3 -I look.py {x} {csv} {half}
touch {x}/a-ready
while [ ! -e {x}/b-done ]; do sleep 0.1; done
'''
PEEK = '''while [ ! -e {x}/a-ready ]; do sleep 0.1; done
/usr/bin/python3 -I look.py {x} {csv} {half}
touch {x}/b-done
'''


def test_a_runner_sees_nothing_another_runner_leaves(host_mqueue, make_rig) -> None:
    with make_rig(vms=False, min_idle=2, max_runners=2, network="none", shutdown_grace_seconds=0) as rig:
        exchange = rig.root / "exchange"
        exchange.mkdir(mode=0o1777)
        exchange.chmod(0o1777)
        words = {"x": shlex.quote(str(exchange)), "places": " ".join(PLACES), "csv": ",".join(PLACES),
                 "secret": SECRET, "half": SECRET.removesuffix("-secret")}
        wait_until(lambda: len(rig.fleet.runners()) == 2, 60, "two idle runners")
        rig.enqueue(1, [{"run": LEAVE.format(**words)}], files={"look.py": LOOK})
        wait_until(lambda: any(r.job for r in rig.fleet.runners()), 60, "the first runner to take its job")
        rig.enqueue(2, [{"run": PEEK.format(**words)}], files={"look.py": LOOK})
        results = wait_until(lambda: len(rig.github.results()) == 2 and rig.github.results(), 120, "both jobs")
        shutil.rmtree(exchange)  # what the jobs left for each other here, as their uids
    seen = {job["run_id"]: json.loads(next(line for line in job["result"]["log"].splitlines()
                                           if line.startswith("seen ")).split(" ", 1)[1]) for job in results}
    everything = {*PLACES, "mqueue", "sysv", "abstract", "cmdline"}
    assert seen[700001] == dict.fromkeys(everything, True), results[0]["result"]["log"]  # the probes work
    assert seen[700002] == dict.fromkeys(everything, False)


# What one job leaves under its uid and the next job on that uid looks for: a queue in /dev/mqueue and a
# key in its uid's user keyring (add_key(2) on x86-64 is call 248; KEY_SPEC_USER_KEYRING is -4).
NEXT = r'''
import ctypes, json, os, sys
def add_key():
    libc = ctypes.CDLL(None, use_errno=True)
    made = libc.syscall(248, b"user", b"mvc-wall-key", b"left-by-the-last-job", 20, ctypes.c_long(-4))
    return "added" if made >= 0 else os.strerror(ctypes.get_errno())
left = {}
if sys.argv[1] == "leave":
    open("/dev/mqueue/mvc-wall-next", "w").close()
    left["add_key"] = add_key()
keys = open("/proc/keys").read()  # every key this uid may see
left.update(uid=os.getuid(), queue=os.path.exists("/dev/mqueue/mvc-wall-next"), key="mvc-wall-key" in keys)
print("next " + json.dumps(left))
'''


def test_the_next_runner_on_a_uid_finds_no_queue_and_no_key_of_the_last(host_mqueue, make_rig, monkeypatch) -> None:
    # One uid for every runner of this test (the top of the range, which the lowest-first lease of other
    # fleets reaches last), given again at once: the next runner gets the uid the last one had.
    top = uidrange.RUNNER_UIDS[-1]
    monkeypatch.setattr(uidrange, "RUNNERS", uidrange.UidRange(range(top, top + 1), uidrange.RUNNERS.leases, "runner"))
    monkeypatch.setattr(workdir, "QUARANTINE_SECONDS", 0)
    with make_rig(vms=False, min_idle=0, max_runners=1) as rig:
        rig.enqueue(1, [{"run": "/usr/bin/python3 -I next.py leave"}], files={"next.py": NEXT})
        first = _next_report(wait_until(lambda: rig.github.results(), 120, "the first job")[0])
        assert first == {"uid": top, "add_key": "Operation not permitted", "queue": True, "key": False}
        wait_until(lambda: not rig.fleet.runners(), 60, "its runner to end")
        rig.enqueue(2, [{"run": "/usr/bin/python3 -I next.py look"}], files={"next.py": NEXT})
        then = _next_report(wait_until(lambda: len(rig.github.results()) == 2 and rig.github.results(), 120,
                                       "the next job")[1])
    assert then == {"uid": top, "queue": False, "key": False}


def _next_report(job: dict) -> dict:
    return json.loads(next(line for line in job["result"]["log"].splitlines() if line.startswith("next ")).split(" ", 1)[1])


def test_a_uid_that_owns_kernel_keys_is_never_leased(account: Account, monkeypatch) -> None:
    monkeypatch.setattr(workdir, "QUARANTINE_SECONDS", 0)
    user = RunnerUser.lookup(account.user)
    first = user.lease()
    first.release()
    as_uid(first.uid, ADD_KEY)  # what a job could do past the walls: a key in its uid's user keyring
    try:
        second = user.lease()
        second.release()
    finally:
        as_uid(first.uid, PURGE_KEYS)
    assert second.uid != first.uid


def test_a_queue_a_released_uid_left_in_the_hosts_dev_mqueue_goes_with_it(account: Account, host_mqueue) -> None:
    identity = RunnerUser.lookup(account.user).lease()
    queue = host_mqueue / f"mvc-left-{identity.uid}"
    try:
        as_uid(identity.uid, f"open({str(queue)!r}, 'w').close()")
        assert queue.exists() and queue.stat().st_uid == identity.uid
        identity.release()
        assert not queue.exists(), "the released uid's queue is still in the host's /dev/mqueue"
    finally:
        queue.unlink(missing_ok=True)


ADD_KEY = """import ctypes
assert ctypes.CDLL(None).syscall(248, b"user", b"mvc-lease-key", b"x", 1, ctypes.c_long(-4)) >= 0"""
# The uid's user session and user keyrings, found without making them, invalidated (keyctl 0 and 21):
# the key in them goes too, and the kernel forgets the uid.
PURGE_KEYS = """import ctypes
libc = ctypes.CDLL(None)
rings = [libc.syscall(250, 0, ctypes.c_long(ring), 0) for ring in (-5, -4)]
for ring in rings:
    if ring > 0:
        libc.syscall(250, 21, ring)"""


def as_uid(uid: int, code: str) -> None:
    """Run Python `code` as `uid` on the host, outside any walls."""
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-I", "-c",
                    code], check=True, cwd="/")


def test_doctor_lists_the_walls_in_force() -> None:
    lines = {name: (on, why) for name, on, why in walls.in_force("none")}
    assert lines["PID namespace"][0] and lines["IPC namespace"][0] and lines["network namespace"][0]
    assert "/dev/shm" in lines["mount namespace"][1]
    assert "/dev/mqueue" in lines["IPC namespace"][1]
    assert lines["no kernel keyring"][0] and "keyctl" in lines["no kernel keyring"][1]
    assert lines["memory and CPU limits"] == (True, "runners.memory_mib and runners.cpu_weight, on the runner's cgroup")


def test_every_process_of_a_runner_is_held_to_its_memory_and_cpu_limits(make_rig) -> None:
    with make_rig(vms=False, min_idle=1, max_runners=1, memory_mib=300, cpu_weight=50,
                  shutdown_grace_seconds=0) as rig:
        runner = wait_until(lambda: rig.fleet.runners(), 60, "a runner")[0]
        limits = wait_until(lambda: _settled_limits(runner.cgroup.pids()), 30, "the runner's processes")
    assert set(limits.values()) == {(300 << 20, round(50 * 10.24))}, limits


def _settled_limits(pids: list[int]) -> dict[int, tuple[int, int]] | None:
    """The limits of each of a runner's processes once the runner program runs (as a uid other than root), or
    None before: while the walls go up, short-lived `mount` processes come and go, and one that ends between
    the cgroup's list and the read of its /proc entry is no finding."""
    try:
        uids = {os.stat(f"/proc/{pid}").st_uid for pid in pids}
        limits = {pid: _limits_of(pid) for pid in pids}
    except (FileNotFoundError, ProcessLookupError):
        return None
    return limits if len(pids) >= 3 and uids - {0} else None


def _limits_of(pid: int) -> tuple[int, int]:
    """(memory limit, CPU weight as v1 shares) of the cgroups a process is in: v2's one group, or v1's
    memory and cpu groups."""
    from runner.vm.cgroup import v1_mount

    groups = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        path = Path("/sys/fs/cgroup") / groups[""].lstrip("/")
        return int((path / "memory.max").read_text()), round(int((path / "cpu.weight").read_text()) * 10.24)
    memory = next(path for controllers, path in groups.items() if "memory" in controllers.split(","))
    cpu = next(path for controllers, path in groups.items() if "cpu" in controllers.split(","))
    memory_root, cpu_root = v1_mount("memory"), v1_mount("cpu")
    assert memory_root is not None and cpu_root is not None
    return (int((memory_root / memory.lstrip("/") / "memory.limit_in_bytes").read_text()),
            int((cpu_root / cpu.lstrip("/") / "cpu.shares").read_text()))
