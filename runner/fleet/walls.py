"""The walls between a host's runners: what one runner's job can see of another's, and of the host.

A runner's own uid (runner.fleet.workdir) keeps other runners out of its files and processes where
the kernel checks uids; it does not hide them. So each runner starts, as root, inside namespaces of
its own (util-linux `unshare`), and only then drops to its uid (`setpriv`, no new privileges, no
capabilities left in any set):

- a PID namespace with its own /proc: another runner's processes (their command lines, which may
  carry another repository's credentials) do not exist for it;
- a private mount namespace with its own tmpfs on /tmp, /var/tmp, /dev/shm and /run/lock: nothing
  it leaves there is seen by another runner, nor by the next runner that gets the same uid, and
  all of it is gone with the namespace;
- an IPC namespace: System V shared memory, semaphores and message queues of its own, and POSIX
  message queues of its own, also by path: a fresh mqueue filesystem of that namespace covers the
  host's /dev/mqueue (runner.fleet.lastwalls), which would otherwise show the host's queues;
- no kernel keyring: add_key, request_key and keyctl fail (a seccomp filter, runner.fleet.lastwalls),
  since no namespace separates a uid's keyring from the next runner of that uid;
- with `runners.network: none`, a network namespace with nothing in it (not even loopback up): no host
  loopback service, no metadata address, no abstract Unix socket of the host or another runner. The
  job API is a Unix socket on the filesystem, which it still reaches. The default (`host`) shares
  the host's network: docs/fleet.md says what that leaves in reach.

The first process of the runner (root) waits for the fleet to put it into the runner's cgroup before
it makes the namespaces, so nothing of the runner ever runs outside it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from runner.errors import ConfigError

NETWORKS = ("host", "none")
# Each runner's own, private tmpfs mounts (mode 1777 as on the host), sized so that one job cannot
# fill the host's memory through them.
PRIVATE_TMPFS = (("/tmp", "1g"), ("/var/tmp", "1g"), ("/dev/shm", "256m"), ("/run/lock", "4m"))
# The places above hide the host's files below them from every runner, so nothing a runner must run or
# reach may lie there; where to put it instead:
WHERE_INSTEAD = ("clone microvm-check to /opt/microvm-check and run scripts/setup there; install_dir "
                 "/opt/microvm-check/actions-runner, runners_dir /var/lib/microvm-check-runners, the socket in "
                 "/run/microvm-check/")
UNSHARE = "/usr/bin/unshare"
SETPRIV = "/usr/bin/setpriv"


class WallsUnavailable(ConfigError):
    """This host lacks what the walls need; the message says what to install."""


def launch_argv(program: Sequence[str], uid: int, gid: int, groups: Sequence[int], network: str) -> list[str]:
    """The runner's command line, started as root: wait for "go" on stdin (the fleet puts the process
    into the runner's cgroup first), make the namespaces, mount the private tmpfs, cover the message
    queue mounts and refuse the keyring (runner.fleet.lastwalls, this installation's Python, isolated),
    drop to the runner's uid and run `program` (relative to the working directory) with stdin from
    /dev/null."""
    missing = [tool for tool in (UNSHARE, SETPRIV) if not Path(tool).exists()]
    if missing:
        raise WallsUnavailable(f"{', '.join(missing)} missing: install util-linux (runners are walled off with it)")
    if network not in NETWORKS:
        raise ValueError(f"runners.network: {network!r} is not one of {', '.join(NETWORKS)}")
    unshare = [UNSHARE, "--pid", "--fork", "--mount-proc", "--mount", "--ipc", "--propagation", "private"]
    if network == "none":
        unshare.append("--net")
    mounts = "".join(f"mount -t tmpfs -o mode=1777,nosuid,nodev,size={size} mvc-runner-tmp {shlex.quote(where)}\n"
                     for where, size in PRIVATE_TMPFS)
    last = [sys.executable, "-I", "-m", "runner.fleet.lastwalls"]
    drop = [*last, SETPRIV, f"--reuid={uid}", f"--regid={gid}", f"--groups={','.join(str(g) for g in groups) or str(gid)}",
            "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--", *program]
    # PID 1 of the namespace stays this shell (it waits, and exits with the runner's status), so the
    # runner itself is an ordinary process: signals reach it as they would on the host.
    inner = f"set -e\n{mounts}set +e\n{shlex.join(drop)} </dev/null\nstatus=$?\nexit $status\n"
    return ["/bin/sh", "-c", 'read -r go && [ "$go" = go ] && exec "$@"', "sh", *unshare, "/bin/sh", "-c", inner]


def runner_paths(install_dir: Path, runners_dir: Path, socket: str) -> dict[str, Path]:
    """What each runner must see of the host, by what it is: the release it is copied from, its own
    directory, the job API socket its hooks talk to, and this installation (its Python runs the hooks and
    the walls' last step, its code is what that Python imports)."""
    return {"runners.install_dir": install_dir, "runners.runners_dir": runners_dir, "the job API socket": Path(socket),
            "this installation's Python (the runners' hooks run it)": Path(sys.executable),
            "this installation's code": Path(__file__).resolve().parents[1]}


def hidden(paths: Mapping[str, Path]) -> list[str]:
    """Which of `paths` a runner cannot see, each said with where it lies: under a place each runner gets
    an empty tmpfs of its own on. The path as given counts, and so do where its directories' links lead
    (a venv's `python` is itself a link to the system's, which says nothing of where the venv is) and
    where the whole path leads."""
    places = [Path(where) for where, _ in PRIVATE_TMPFS]
    found = []
    for what, path in paths.items():
        absolute = Path(os.path.abspath(path))
        ways = dict.fromkeys((absolute, absolute.parent.resolve() / absolute.name, absolute.resolve()))
        why = next((_why(path, seen, place) for seen in ways for place in places
                    if seen == place or place in seen.parents), None)
        why = why or next((_why(path, seen, closed, closed=True) for seen in ways
                           if (closed := _closed_to_others(seen)) is not None), None)
        if why is not None:
            found.append(f"{what} {why}")
    return found


def _why(path: Path, seen: Path, place: Path, closed: bool = False) -> str:
    """`path` (and where it leads, `seen`) said with the place that hides it from the runners."""
    via = "" if seen == path else f" ({seen})"
    if closed:
        return (f"{path}{via} lies under {place}, which other users may not enter (mode "
                f"{place.stat().st_mode & 0o777:o}; every runner has a uid of its own)")
    return f"{path}{via} lies under {place}, which every runner sees as an empty tmpfs of its own"


def _closed_to_others(path: Path) -> Path | None:
    """The first existing directory above `path` that a user other than its owner and group may not enter
    (no search bit for others: `/root` is 0700 on Debian), or None. The runners' uids are in no group of
    the host's, so only that bit lets them reach what lies below."""
    for directory in reversed(path.parents):
        try:
            mode = directory.stat().st_mode
        except OSError:
            return None  # what is not there yet is made by the service (runners_dir) or reported elsewhere
        if not mode & 0o001:
            return directory
    return None


def check_visible(paths: Mapping[str, Path]) -> None:
    """Refuse a fleet whose runners could not see what they run: each would exit at once, for ever."""
    found = hidden(paths)
    if found:
        raise WallsUnavailable(f"{'; '.join(found)} (runner/fleet/walls.py): its runners could not start. Put them "
                               f"where the host's own files are: {WHERE_INSTEAD}")


def in_force(network: str) -> list[tuple[str, bool, str]]:
    """The walls a runner of this host gets: (wall, in force, what it means), for `doctor`."""
    tools = shutil.which("unshare") is not None and shutil.which("setpriv") is not None
    namespaces = {name: Path(f"/proc/self/ns/{name}").exists() for name in ("pid", "mnt", "ipc", "net")}
    limits = _has_limit_controllers()
    seccomp = _has_seccomp_filters()
    return [
        ("own uid", True, "no runner reads, signals or traces another's files and processes"),
        ("PID namespace", tools and namespaces["pid"], "another runner's processes and command lines are invisible"),
        ("mount namespace", tools and namespaces["mnt"],
         "own tmpfs on " + ", ".join(where for where, _ in PRIVATE_TMPFS)),
        ("IPC namespace", tools and namespaces["ipc"],
         "own System V IPC and POSIX message queues, with an mqueue mount of its own over /dev/mqueue"),
        ("no kernel keyring", tools and seccomp,
         "add_key, request_key and keyctl fail: a uid's keyring would outlive its runner; uids owning keys are "
         "never leased" if seccomp else "not in force: this kernel has no seccomp filters"),
        ("network namespace", tools and namespaces["net"] and network == "none",
         "no loopback, no metadata address, no abstract sockets of others" if network == "none"
         else "runners.network is host: the host's network, loopback and abstract sockets are shared"),
        ("uid quarantine", True, "a released uid is not leased again for a while"),
        ("memory and CPU limits", limits, "runners.memory_mib and runners.cpu_weight, on the runner's cgroup" if limits
         else "not in force: this host's cgroups lack the memory or cpu controller"),
    ]


def _has_limit_controllers() -> bool:
    """cgroup v2 with memory and cpu, or v1's memory and cpu hierarchies (runner/fleet/cgroup.py)."""
    from runner.vm import cgroup as vm_cgroup

    unified = Path("/sys/fs/cgroup/cgroup.controllers")
    if unified.exists():
        return {"memory", "cpu"} <= set(unified.read_text().split())
    return all(vm_cgroup.v1_mount(controller) is not None for controller in ("memory", "cpu"))


def _has_seccomp_filters() -> bool:
    """The kernel runs seccomp filters (CONFIG_SECCOMP_FILTER), which the keyring wall is."""
    try:
        return "\nSeccomp_filters:" in Path("/proc/self/status").read_text()
    except OSError:
        return False
