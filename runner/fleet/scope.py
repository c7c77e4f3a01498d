"""Which runner cgroup scope a service owns, so that its successor can sweep what a dead one left.

A fleet's runners live in `microvm-check-runners/<scope>/` (runner/fleet/cgroup.py), the scope derived from
its runners directory. A fleet sweeps its own scope when it starts, but a service that died with runners
running and comes back without a `runners:` section (or with another runners_dir) never starts that
fleet again: the old runners and whatever their jobs daemonized would live on, in a cgroup nobody removes.

So a fleet claims its scope while it runs: an flock on `LOCKS/<scope>.lock` (host-wide, root's; the kernel
drops it when the service dies) and a claim file in the service's state directory naming the scope. At
start-up the service (runner.service.host.assembly) sweeps the scope its state directory's claim names, unless the
scope's lock is held: then a live service (another state directory with the same runners_dir) runs
runners there, and those are not ours to kill. The state directory itself is this service's alone (the
engine's lock on its VM directory), so a claim found there was written by a predecessor of this service.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from pathlib import Path
from typing import IO

from runner.errors import ConfigError
from runner.fleet import cgroup

log = logging.getLogger(__name__)

CLAIM_FILE = "runner-scope.json"
LOCKS = Path("/run/microvm-check/runner-scopes")
_SCOPE = re.compile(r"[0-9a-f]{12}")  # cgroup.scope_for's form: a claim file cannot name another path


class ScopeClaim:
    """This service's hold on its runners' cgroup scope, from the fleet's start to its close."""

    def __init__(self, state_dir: Path, scope: str, lock: IO[str]) -> None:
        self.path = state_dir / CLAIM_FILE
        self.scope = scope
        self._lock: IO[str] | None = lock

    @classmethod
    def take(cls, state_dir: Path, scope: str) -> ScopeClaim:
        """Lock `scope` and write the claim; a ConfigError when a live service holds it."""
        lock = _lock(scope)
        if lock is None:
            raise ConfigError(f"another microvm-check service runs runners in this runners_dir (cgroup scope {scope}): "
                              "give each service its own runners.runners_dir")
        claim = cls(state_dir, scope, lock)
        temporary = claim.path.with_name(f".{CLAIM_FILE}.tmp")
        try:
            temporary.write_text(json.dumps({"scope": scope}))
            temporary.chmod(0o600)
            temporary.replace(claim.path)
        except OSError:
            claim.release()
            raise
        return claim

    def release(self) -> None:
        """The fleet closed: the claim goes with its scope; a scope still there (a runner's group that would
        not go) stays claimed, for the next start to sweep. Safe to call twice."""
        if self._lock is None:
            return
        if not cgroup.scope_exists(self.scope):
            self.path.unlink(missing_ok=True)
        self._lock.close()
        self._lock = None


def sweep_stale(state_dir: Path) -> list[str]:
    """Kill the processes of the runner scope a dead predecessor of this service claimed and remove its
    cgroups; say what was found. A scope a live service holds is left alone (its claim here is forgotten)."""
    path = state_dir / CLAIM_FILE
    try:
        scope = json.loads(path.read_text()).get("scope")
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("ignoring the unreadable runner scope claim %s: %s", path, exc)
        scope = None
    if not isinstance(scope, str) or not _SCOPE.fullmatch(scope):
        path.unlink(missing_ok=True)
        return []
    lock = _lock(scope)
    if lock is None:
        log.warning("runner cgroup scope %s (claimed in %s) is held by a live service: left alone", scope, path)
        path.unlink(missing_ok=True)
        return []
    try:
        found = [f"runner cgroup {group.name} of scope {scope}" for group in cgroup.sweep(scope)]
        cgroup.remove_scope(scope)
    except OSError as exc:  # no pids controller (no fleet could have run here), a member that will not die
        log.warning("cannot sweep the runner cgroup scope %s (claimed in %s): %s", scope, path, exc)
        return []
    finally:
        lock.close()
    path.unlink(missing_ok=True)
    return found


def _lock(scope: str) -> IO[str] | None:
    """The scope's lock, taken; None when another process holds it."""
    LOCKS.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(LOCKS / f"{scope}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    lock = os.fdopen(fd, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock
