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
for name, (env_path, pid) in targets.items():
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
    assert attempts[other] == {"name": other, "uid": uids[own], "env": "denied", "environ": "denied",
                               "signal": "denied"}
    assert len(set(uids.values())) == 2 and set(uids.values()) <= set(uidrange.RUNNER_UIDS)
    for name, uid in uids.items():
        assert (env_modes[name].st_uid, stat.S_IMODE(env_modes[name].st_mode)) == (uid, 0o600)
        assert (dir_modes[name].st_uid, dir_modes[name].st_gid, stat.S_IMODE(dir_modes[name].st_mode)) == (uid, uid, 0o700)
