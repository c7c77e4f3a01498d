"""One runner's own directory: a fresh copy of the release, owned by the runner user, deleted after its job.

The copy is a real copy (new inodes), never hard links into the installed release: a job running as
its runner could otherwise write through a link into the release every later runner starts from.
Each runner runs as a uid of its own (`RunnerUidLease`, leased from runner.uidrange.RUNNER_UIDS while
it lives) with a group of its own (the same number), plus the configured runner user's groups (the
job API socket's): so no runner can read another's directory or `.env`, nor read the environment of,
signal or trace another's processes, as runners sharing one user could (the kernel's /proc and ptrace
checks compare uids). The runner's `.env` (read by the runner at start; its values reach every step of
the job) names the job hooks and holds the runner's own credential, readable by that runner's uid only. The hooks
themselves are root's, outside every runner directory, so no job can change what they run: the
job-started hook reports the job to the service, whose fork guard allows or refuses it; the
job-completed hook has the service end whatever the job still runs.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from runner import uidrange
from runner.errors import ConfigError
from runner.fleet.hook import ISOLATION
from runner.jobapi.contract import RUNNER_TOKEN_VARIABLE as TOKEN_VARIABLE
from runner.uidrange import UidLease

HOOKS = "_hooks"
# The runner's variable naming each hook, and the hook's script (and `microvm-check runner` command).
HOOK_SCRIPTS = {"ACTIONS_RUNNER_HOOK_JOB_STARTED": "job-started", "ACTIONS_RUNNER_HOOK_JOB_COMPLETED": "job-completed"}
NAME_VARIABLE = "MICROVM_CHECK_RUNNER_NAME"
# World-writable places a job may leave files in as its uid; a later runner may get the same uid. The walls
# give each runner its own of each (runner.fleet.walls); this sweep is for what got past them.
SHARED_TEMP = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), Path("/dev/mqueue"))
KEY_USERS = Path("/proc/key-users")  # the uids that own kernel keys, and how many
QUARANTINE_SECONDS = 600  # a released runner uid is not leased again before this (the next-lowest is)


class RunnerUserError(ConfigError):
    """The configured runner user cannot run runners."""


class RunnerUidsExhausted(ConfigError):
    """Every uid of the runners' range is leased: more runners than the host can give uids to."""


@dataclass(frozen=True)
class RunnerUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups from /etc/group, e.g. the job API socket's group

    @classmethod
    def lookup(cls, name: str) -> RunnerUser:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise RunnerUserError(
                f"runners.runner_user {name!r} does not exist: create it with `useradd --system --no-create-home "
                f"--shell /usr/sbin/nologin --groups <socket_group> {name}`") from None
        if entry.pw_uid == 0 or entry.pw_gid == 0:
            raise RunnerUserError(f"runners.runner_user {name!r} has uid or gid 0: runners never run as root")
        groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
        if 0 in groups:
            raise RunnerUserError(f"runners.runner_user {name!r} is in group root: give runners a user of their own")
        return cls(name, entry.pw_uid, entry.pw_gid, groups)

    def lease(self) -> RunnerUidLease:
        """A uid of its own for one runner, held until `RunnerUidLease.release`. Skipped: uids an account
        holds (doctor warns of them) and uids still running a process (a crashed service's runner)."""
        lease = uidrange.RUNNERS.lease(
            lambda message: RunnerUidsExhausted(f"{message}: lower runners.max_runners"), _unused_uid)
        return RunnerUidLease(lease.uid, lease.uid, (self.gid, *self.groups), lease)


@dataclass
class RunnerUidLease:
    """What one runner's processes run as: a leased uid, a gid of the same number (no group shares it),
    and the runner user's groups (which include the job API socket's)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    _lease: UidLease = field(repr=False)

    def release(self) -> None:
        """Give the uid back once nothing of the runner is left: no process (its cgroup is emptied), no
        file in its directory, none in the shared temporary directories or the host's message queues
        (removed here). No kernel key: the walls refuse the keyring, and a uid owning keys anyway is never
        leased again. The uid is quarantined for QUARANTINE_SECONDS: whatever a job left where nobody
        looked (an object of a kind no sweep knows) must not meet the next runner at once."""
        remove_owned(self.uid, SHARED_TEMP)
        _quarantine_file(self.uid).write_text(f"released {time.time():.0f}\n")
        self._lease.close()


def _unused_uid(uid: int) -> bool:
    return (not any(entry.pw_uid == uid for entry in pwd.getpwall()) and not processes_of(uid)
            and not _quarantined(uid) and not owns_keys(uid))


def owns_keys(uid: int) -> bool:
    """Whether the kernel holds keys or keyrings owned by `uid` (/proc/key-users). A uid's user keyring
    outlives every process of it, and a job could have locked keys in it that nobody may clear but that
    uid may read (runner.fleet.lastwalls): such a uid is never given to another runner."""
    try:
        text = KEY_USERS.read_text()
    except FileNotFoundError:  # a kernel without keys: none to own
        return False
    return any(line.split(":", 1)[0].strip() == str(uid) for line in text.splitlines())


def _quarantine_file(uid: int) -> Path:
    """The uid's lease file (runner.uidrange), which also records when its last runner released it."""
    return uidrange.RUNNERS.leases / str(uid)


def _quarantined(uid: int, now: float | None = None) -> bool:
    try:
        words = _quarantine_file(uid).read_text().split()
    except OSError:
        return False
    if len(words) != 2 or words[0] != "released" or not words[1].isdigit():
        return False
    return (time.time() if now is None else now) - int(words[1]) < QUARANTINE_SECONDS


def processes_of(uid: int) -> list[int]:
    """Processes whose real, effective or saved uid is `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                uids = next(line for line in status if line.startswith("Uid:")).split()[1:4]
        except (OSError, StopIteration):
            continue
        if str(uid) in uids:
            found.append(int(entry))
    return found


def remove_owned(uid: int, places: tuple[Path, ...]) -> None:
    """Remove the entries directly in `places` that `uid` owns (what a job left in /tmp and the like);
    rmtree never follows a link."""
    for place in places:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    remove(Path(entry.path))
            except OSError:
                continue


@dataclass(frozen=True)
class RunnerDir:
    path: Path

    @property
    def log(self) -> Path:
        return self.path / "_diag" / "microvm-check-runner.log"

    def environment(self) -> dict[str, str]:
        """The runner process's whole environment: nothing of the service's own is passed on."""
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.path / "_home"),
                "TMPDIR": str(self.path / "_tmp"), "LANG": "C.UTF-8"}


def install_hooks(runners_dir: Path, socket: str) -> dict[str, Path]:
    """The root-owned hooks every runner's `.env` names (by the runner's variable): each leaves the job's
    workspace, drops `PYTHON*` and runs this installation's Python isolated (`-I`, absolute paths),
    talking to the service on `socket` with the runner's token."""
    hooks = runners_dir / HOOKS
    hooks.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chown(hooks, 0, 0)
    os.chmod(hooks, 0o755)
    return {variable: _write_hook(hooks, command, socket) for variable, command in HOOK_SCRIPTS.items()}


def _write_hook(hooks: Path, command: str, socket: str) -> Path:
    argv = shlex.join([sys.executable, "-I", "-m", "runner.cli", "runner", command, "--socket", socket])
    text = ("#!/bin/sh\n# Written by the microvm-check service (runner/fleet/workdir.py); runs in the job's workspace.\n"
            f"{ISOLATION}exec {argv}\n")
    script = hooks / f"{command}.sh"
    temporary = hooks / f".{command}.sh.tmp"
    temporary.write_text(text)
    temporary.chmod(0o755)
    temporary.replace(script)
    return script


def make(release: Path, path: Path, user: RunnerUidLease, name: str, token: str,
         hooks: dict[str, Path]) -> RunnerDir:
    """A fresh runner directory at `path` (which must not exist) for one runner's `user`, mode 0700,
    its `.env` 0600: nothing in it is readable by another runner's uid."""
    shutil.copytree(release, path, symlinks=True, copy_function=shutil.copy2)
    runner = RunnerDir(path)
    for sub in ("_work", "_home", "_tmp", "_diag"):
        (path / sub).mkdir(exist_ok=True)
    _own(path, user)
    env = {**{variable: str(script) for variable, script in hooks.items()}, NAME_VARIABLE: name, TOKEN_VARIABLE: token}
    write_private(path / ".env", "".join(f"{key}={value}\n" for key, value in env.items()), user.uid, user.gid)
    os.chmod(path, 0o700)
    return runner


def write_private(path: Path, text: str, uid: int, gid: int) -> None:
    """A new file of `uid`'s, mode 0600 from its creation (never the service's umask, not even for an
    instant); one the release brought under that name is replaced, a link never followed."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchown(fd, uid, gid)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a runner directory whatever its job left in it; root needs no write bits, and rmtree
    never follows a link a job planted."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _own(root: Path, user: RunnerUidLease) -> None:
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(directory, name), user.uid, user.gid)
    os.chown(root, user.uid, user.gid)
