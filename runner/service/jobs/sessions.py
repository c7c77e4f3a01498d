"""One VM across a GitHub job's steps (`keep: job`): a session holds the VM between the steps' execs.

A session rests on a secret only its job has: the first `keep: job` step opens it and is answered
the session's token (the action keeps it in a 0600 file under RUNNER_TEMP, which only the job's
later steps find, never in the guest's environment); a later step attaches only by presenting it.
The key (repository, run, attempt, job and runner, as the runner binding in runner/service/jobs/auth.py
checks at submit) must match as well, so a token carried to another job opens nothing. Values a
client sends are not a credential: a later job (or a local runner that reuses run ids, as nektos/act
does) that names the same run, attempt, job and runner but has no token gets a VM of its own, and
cannot end the kept one either.

Each later step of the job attaches: no checkout, its own exec, its own record and log. A step with
`keep: none` (the default) that presents the token runs in the session and ends it; so do the
job-completed hook, the `completed` webhook, the runner's end and the idle TTL, whichever comes
first. The VM's own engine TTL (`KEEP_MAX_SECONDS`) bounds it even if the service dies.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runner.errors import JobError
from runner.jobapi.contract import MAX_TOKEN, GitHubJob, JobSpec
from runner.sandbox.port import SandboxLike, TemplateChoice

log = logging.getLogger(__name__)

KEEP_IDLE_SECONDS = 900.0  # a kept VM waits at most this long for the job's next step
KEEP_MAX_SECONDS = 6 * 3600  # a kept VM's hard life in the engine: GitHub's own limit for a job


def session_key(spec: JobSpec) -> GitHubJob | None:
    """The GitHub job whose session a step may open or join; None when the spec does not name its job."""
    job = spec.github
    return job if job is not None and job.job else None


@dataclass
class Session:
    """A kept VM and what the job's later steps must match to use it."""

    id: str
    key: GitHubJob
    template: str  # the template its first step named, and the size class it asked for
    size: str | None
    policy_digest: str
    touched: float
    token_digest: bytes = field(repr=False, default=b"")  # SHA-256 of the session's token
    sandbox: SandboxLike | None = None  # None until the first step's VM is up, and again once it has ended
    choice: TemplateChoice | None = None  # what its VM restores from, as its first step's worker chose
    steps: int = 0
    busy: bool = False  # a step is between its submit and its end: the next one waits for it to end
    ended: str | None = None  # why it ended
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, sandbox: SandboxLike, now: float) -> bool:
        """After a step: keep its VM for the next. False when the session ended meanwhile (destroy it)."""
        with self.lock:
            self.busy = False
            self.touched = now
            if self.ended is not None:
                return False
            self.sandbox = sandbox
            return True


class SessionConflict(JobError):
    """A step that cannot join its job's kept VM (answered 409); the message says why."""


class Sessions:
    """The service's sessions by id, found by their token; every path that ends one destroys its VM exactly once."""

    def __init__(self, destroy: Callable[[SandboxLike], None], idle_seconds: float = KEEP_IDLE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._destroy = destroy
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._by_digest: dict[bytes, Session] = {}

    def join(self, key: GitHubJob, keep: str, template: str, size: str | None, policy_digest: str,
             token: str | None = None) -> tuple[Session | None, str | None]:
        """The session a step runs in, and the new session's token when this step opens one.

        A step that presents the token of an open session of its own job attaches to it; a
        `keep: job` step without one (or with the token of a session that has ended) opens a new
        session; any other step is a plain one (None). The step holds the session (busy) until
        `release` or `hold`.
        """
        with self._lock:
            session = self._find(key, token)
            if session is None:
                if keep != "job":
                    return None, None
                new_token = secrets.token_urlsafe(32)
                session = Session("s" + secrets.token_hex(8), key, template, size, policy_digest, self._clock(),
                                  _digest(new_token))
                self._by_digest[session.token_digest] = session
            else:
                new_token = None
            with session.lock:
                _check_joinable(session, template, size, policy_digest)
                session.busy = True
                session.steps += 1
                session.touched = self._clock()
            return session, new_token

    def _find(self, key: GitHubJob, token: str | None) -> Session | None:
        """The open session `token` opens, if it belongs to `key`'s job (called under self._lock)."""
        if not token or len(token) > MAX_TOKEN:
            return None
        session = self._by_digest.get(_digest(token))
        if session is None or session.key != key:
            return None
        return session

    def release(self, session: Session) -> None:
        """A step that joined but never ran (its submit failed, it was cancelled while queued): the
        session is free for the next step; a session whose first step never ran ends."""
        with session.lock:
            session.busy = False
            session.touched = self._clock()
            fresh = session.sandbox is None
        if fresh:
            self.end(session, "its first step never ran")

    def end(self, session: Session, why: str) -> None:
        """End the session and destroy its VM (idempotent)."""
        with self._lock:
            if self._by_digest.get(session.token_digest) is session:
                del self._by_digest[session.token_digest]
        with session.lock:
            if session.ended is None:
                session.ended = why
            sandbox, session.sandbox = session.sandbox, None
        if sandbox is not None:
            log.info("session %s (%s on runner %s) ends: %s", session.id, session.key.describe(),
                     session.key.runner or "?", why)
            self._destroy(sandbox)

    def end_where(self, match: Callable[[GitHubJob], bool], why: str) -> list[str]:
        """End every session whose key matches; their ids."""
        with self._lock:
            chosen = [s for s in self._by_digest.values() if match(s.key)]
        for session in chosen:
            self.end(session, why)
        return [session.id for session in chosen]

    def expire(self) -> list[str]:
        """End sessions no step has used for `idle_seconds` (a step that runs keeps it alive)."""
        now = self._clock()
        with self._lock:
            idle = [s for s in self._by_digest.values() if not s.busy and now - s.touched > self.idle_seconds]
        for session in idle:
            self.end(session, f"no step used it for {self.idle_seconds:g} s")
        return [session.id for session in idle]

    def close(self, why: str) -> None:
        self.end_where(lambda _key: True, why)

    def count(self) -> int:
        with self._lock:
            return len(self._by_digest)

    def holds(self, vm_id: str) -> bool:
        """Whether a live session keeps the VM `vm_id` for its job's next step (the lifecycle log says so)."""
        with self._lock:
            sessions = list(self._by_digest.values())
        return any(s.ended is None and s.sandbox is not None and s.sandbox.id == vm_id for s in sessions)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _check_joinable(session: Session, template: str, size: str | None, policy_digest: str) -> None:
    if session.ended is not None:
        raise SessionConflict(f"the job's kept VM has ended ({session.ended})")
    if session.busy:
        raise SessionConflict("another step of this job still runs in its kept VM; steps of a job run one at a time")
    if (session.template, session.size) != (template, size):
        raise SessionConflict(f"the job's kept VM was restored from template {_sized(session.template, session.size)}, "
                              f"this step asks for {_sized(template, size)}: a kept VM keeps its first step's template")
    if session.policy_digest != policy_digest:
        raise SessionConflict("this step's egress policy differs from the one the job's kept VM was started with: "
                              "a kept VM keeps its first step's policy (give every step the same `policy` input)")


def _sized(template: str, size: str | None) -> str:
    return template if size is None else f"{template} at the size class {size}"


def destroy_kept(sandbox: SandboxLike) -> None:
    """A kept VM whose session ended; a failure is logged (the engine's TTL and sweep remain)."""
    try:
        sandbox.destroy()
    except Exception:
        log.exception("destroying kept VM %s failed", sandbox.id)
