"""The host's side of the fleet's runners: the directory, uid, cgroup and process each runs in, and what
a dead predecessor's runners left behind.

Kept apart from the fleet's bookkeeping (fleet.py: how many runners, which is busy, when one is
replaced) because this is what touches the host: a runner is started as a uid of its own, leased
for its life (runner.fleet.workdir), in a fresh directory, a cgroup (runner.fleet.cgroup) and
namespaces of its own (runner.fleet.walls), and when it ends all of that goes with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

from runner.fleet import cgroup, walls, workdir
from runner.fleet.cgroup import RunnerCgroup
from runner.fleet.install import current
from runner.fleet.model import FleetRunner, FleetSettings
from runner.fleet.scope import ScopeClaim
from runner.fleet.workdir import RunnerDir, RunnerUidLease, RunnerUser
from runner.github.runners import JitConfig

log = logging.getLogger(__name__)

# What a runner's start may fail with on this host (it is then tried again later); its pieces are gone.
START_ERRORS = (OSError, workdir.RunnerUidsExhausted, walls.WallsUnavailable)


class RunnerProcesses:
    """Starts, signals and removes the runners' processes with everything they run in."""

    def __init__(self, settings: FleetSettings) -> None:
        self.settings = settings
        self.scope = cgroup.scope_for(settings.runners_dir)
        self.claim: ScopeClaim | None = None
        self.user: RunnerUser | None = None
        self._release: Path | None = None
        self._hooks: dict[str, Path] = {}

    def prepare(self) -> None:
        """Check that runners can see what they run, the user and the installed release; claim the runners'
        cgroup scope and clean up after a predecessor."""
        settings = self.settings
        walls.check_visible(walls.runner_paths(settings.install_dir, settings.runners_dir, settings.socket))
        self.user = RunnerUser.lookup(settings.runner_user)
        self._release = current(settings.install_dir)
        runners_dir = settings.runners_dir
        runners_dir.mkdir(parents=True, exist_ok=True)
        os.chown(runners_dir, 0, 0)
        os.chmod(runners_dir, 0o711)  # a runner can reach its own directory, not list the others
        self._hooks = workdir.install_hooks(runners_dir, settings.socket)
        self.claim = ScopeClaim.take(settings.state_dir, self.scope)  # before the sweep: not a live one's
        self._recover()

    def close(self) -> None:
        """After the last runner: the scope goes, and the claim on it."""
        cgroup.remove_scope(self.scope)
        if self.claim is not None:
            self.claim.release()

    def start(self, name: str, jit: JitConfig, token: str, now: float) -> FleetRunner:
        """Runner `name` started with its JIT config and credential; one of START_ERRORS after removing what
        was made of it."""
        assert self.user is not None and self._release is not None and self._hooks
        path = self.settings.runners_dir / name
        group: RunnerCgroup | None = None
        identity: RunnerUidLease | None = None
        try:
            identity = self.user.lease()
            runner_dir = workdir.make(self._release, path, identity, name, token, self._hooks)
            group = RunnerCgroup.create(self.scope, name, self.settings.limits)
            process, output = self._launch(runner_dir, jit, group, identity)
        except START_ERRORS:
            if group is not None:
                group.destroy()
            workdir.remove(path)
            if identity is not None:
                identity.release()
            raise
        return FleetRunner(name, runner_dir, jit.runner.id, process, group, now, token, identity, output=output)

    def _launch(self, runner_dir: RunnerDir, jit: JitConfig, group: RunnerCgroup,
                user: RunnerUidLease) -> tuple[subprocess.Popen[bytes], int]:
        """`run.sh` with the JIT config as ACTIONS_RUNNER_INPUT_JITCONFIG (how the runner takes any of its
        arguments, here kept out of `ps`), as the runner's own uid, in a session, a cgroup and
        namespaces of its own (runner.fleet.walls).

        The runner cannot move itself into a root-owned cgroup, so a shell waits on a pipe
        until this process has put it there, and only then makes the namespaces and execs `run.sh`:
        nothing of the runner ever runs outside the group. Also returns the descriptor of the runner's
        output file, kept to read what it said if it ends before taking a job (runner.fleet.starts)."""
        log_fd = os.open(runner_dir.log, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchown(log_fd, user.uid, user.gid)
            argv = walls.launch_argv(["./run.sh"], user.uid, user.gid, user.groups, self.settings.network)
            process = subprocess.Popen(
                argv, cwd=runner_dir.path,
                env={**runner_dir.environment(), "ACTIONS_RUNNER_INPUT_JITCONFIG": jit.encoded_jit_config},
                umask=0o077, start_new_session=True, stdin=subprocess.PIPE, stdout=log_fd, stderr=subprocess.STDOUT)
        except BaseException:
            os.close(log_fd)
            raise
        assert process.stdin is not None
        try:
            group.add(process.pid)
            process.stdin.write(b"go\n")
        except OSError:
            process.kill()
            process.wait()
            os.close(log_fd)
            raise
        finally:
            process.stdin.close()
        return process, log_fd

    def kill(self, runner: FleetRunner, signum: int = signal.SIGKILL) -> None:
        """Signal the runner's whole session; SIGKILL also reaches what its job started in sessions of
        its own (the runner's cgroup)."""
        try:
            os.killpg(runner.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        if signum == signal.SIGKILL:
            for pid in runner.cgroup.pids():
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    def remove(self, runner: FleetRunner) -> None:
        """The runner has ended: its cgroup (whatever its job left running), its directory and its uid go."""
        try:
            runner.cgroup.destroy()
        except cgroup.CgroupError as exc:
            log.error("runner %s: %s", runner.name, exc)
        workdir.remove(runner.dir.path)
        if runner.identity is not None:
            runner.identity.release()
        if runner.output >= 0:
            os.close(runner.output)

    def _recover(self) -> None:
        """Kill what a dead predecessor's runners still run and remove their directories."""
        runners_dir = self.settings.runners_dir
        for group in cgroup.sweep(self.scope):
            log.warning("killed what runner %s of a previous service left running (its cgroup)", group.name)
        for pid in processes_in(runners_dir):
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            log.warning("killed process %d of a runner left by a previous service", pid)
        for entry in runners_dir.iterdir():
            if entry.name != workdir.HOOKS:
                log.warning("removing %s: a runner directory left by a previous service", entry)
                workdir.remove(entry)


def processes_in(directory: Path) -> list[int]:
    """Processes whose working directory or program lies under `directory`."""
    marker = str(directory).rstrip("/") + "/"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        for link in ("cwd", "exe"):
            try:
                target = os.readlink(f"/proc/{entry}/{link}")
            except OSError:
                continue
            if target.startswith(marker):
                found.append(int(entry))
                break
    return found
