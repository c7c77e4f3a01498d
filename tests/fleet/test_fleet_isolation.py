"""Each fleet runner runs as a uid of its own: a job on one runner cannot take another runner's token.

Runners sharing one user could read each other's `.env` (MICROVM_CHECK_RUNNER_TOKEN) and
/proc/PID/environ, signal and trace each other's processes, and so submit as the other runner. Here
a real job on a stand-in runner tries exactly that against the other, idle runner (no VM needed: the
job's step runs on the host as the runner runs it), and, as a control, against itself.
"""

from __future__ import annotations

import json
import os
import shlex
import stat

from runner import uidrange
from tests.fleet.test_fleet import wait_until

# A job step: for each runner it is given (name -> .env path, runner pid), try its .env (the runner's
# token), its process's environment (the JIT config, the runner's GitHub credential) and a signal;
# print one JSON line per runner.
ATTEMPT = r'''
import json, os, sys
targets = json.loads(sys.argv[1])

def own_runner():
    # the runner as its job sees it: in the runner's own PID namespace, an ancestor of this step
    pid = os.getppid()
    while pid > 1:
        if b"standin_runner" in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    raise SystemExit("no runner among this step's ancestors")

for name, (env_path, pid) in targets.items():
    pid = own_runner() if name == os.environ["RUNNER_NAME"] else pid
    tried = {"name": name, "uid": os.getuid()}
    for what, secret, action in (
            ("env", b"MICROVM_CHECK_RUNNER_TOKEN=", lambda: open(env_path, "rb").read()),
            ("environ", b"ACTIONS_RUNNER_INPUT_JITCONFIG=", lambda: open(f"/proc/{pid}/environ", "rb").read()),
            ("signal", b"", lambda: os.kill(pid, 0))):
        try:
            data = action()
            tried[what] = "secret" if data and secret in data else "ok"
        except PermissionError:
            tried[what] = "denied"
        except (FileNotFoundError, ProcessLookupError):
            tried[what] = "invisible"  # another PID namespace: the process does not exist here
    print("attempt " + json.dumps(tried))
'''


def test_a_job_cannot_read_another_runners_env_or_process_environment(make_rig) -> None:
    with make_rig(vms=False, min_idle=2, max_runners=2) as rig:
        runners = wait_until(lambda: len(rig.fleet.runners()) == 2 and rig.fleet.runners(), 60, "two runners")
        targets = {r.name: (str(r.dir.path / ".env"), r.process.pid) for r in runners}
        env_modes = {r.name: os.stat(r.dir.path / ".env") for r in runners}
        dir_modes = {r.name: os.stat(r.dir.path) for r in runners}
        uids = {r.name: r.identity.uid for r in runners}
        attempt = rig.root / "attempt.py"  # the rig's root is readable by every runner
        attempt.write_text(ATTEMPT)
        attempt.chmod(0o644)
        rig.enqueue(1, [{"run": shlex.join(["/usr/bin/python3", "-I", str(attempt), json.dumps(targets)])}])
        result = wait_until(lambda: rig.github.results(), 120, "the job to end")[0]["result"]
    assert result["conclusion"] == "success", result["log"]
    attempts = {a["name"]: a for a in (json.loads(line.split(" ", 1)[1])
                                        for line in result["log"].splitlines() if line.startswith("attempt "))}
    own, other = result["runner"], next(name for name in targets if name != result["runner"])
    assert attempts[own] == {"name": own, "uid": uids[own], "env": "secret", "environ": "secret", "signal": "ok"}
    assert attempts[other] == {"name": other, "uid": uids[own], "env": "denied", "environ": "invisible",
                               "signal": "invisible"}  # its own uid, and its own PID namespace
    assert len(set(uids.values())) == 2 and set(uids.values()) <= set(uidrange.RUNNER_UIDS)
    for name, uid in uids.items():
        assert (env_modes[name].st_uid, stat.S_IMODE(env_modes[name].st_mode)) == (uid, 0o600)
        assert (dir_modes[name].st_uid, dir_modes[name].st_gid, stat.S_IMODE(dir_modes[name].st_mode)) == (uid, uid, 0o700)
