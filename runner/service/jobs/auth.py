"""Who may do what on the job API: every rule in one place (docs/job-api.md, "Who may do what").

Callers:
- the operator: root or a member of `admin_group` on the Unix socket (told by SO_PEERCRED, which the
  kernel fills in: a client cannot claim it), or a TCP client with the bearer token (checked on the
  head by the API's gate). The operator may do everything: `microvm-check run`, listing all jobs.
- a fleet runner: a request carrying a runner token (RUNNER_TOKEN_HEADER) the fleet issued (and
  wrote into that runner's `.env` only). It may report its job (the job-started hook), submit only
  for the job it reported, and end what that job still runs (the job-completed hook).
- a registered runner: the single runner `microvm-check register --service-config` set up, with a
  credential of its own (runner/fleet/registered.py): bound to the job its hook reports, as a fleet
  runner is, until that job ends, then free for its next job. Its credential outlives its jobs and a
  step holds it too, so the report alone binds nothing: the job must be one GitHub's signed
  `workflow_job in_progress` delivery put on the runner (a service with a webhook), and of the
  repository the operator held the credential to, if any; without a webhook a credential must name
  one, or the runner takes no job.
- a socket member: any other process that can connect (the socket group). With a fleet (`runners:`
  set) it may do nothing but ask for health; without one it may submit local jobs only: they run
  under the repository name the operator set in `local_jobs.repository` (and that name's policy),
  whatever repository the submit names; without that setting it may not submit.

Every job gets its own token at submit; reading, streaming, cancelling and uploading for a job need
it (or the operator). Tokens are kept as SHA-256 digests only, and looked up by digest, so no
comparison leaks a prefix of a good one.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from runner.errors import ConfigError, JobError
from runner.fleet.registered import Credential
from runner.jobapi.contract import (
    JOB_TOKEN_HEADER,
    MAX_TOKEN,
    RUNNER_TOKEN_HEADER,
    RUNNER_TOKEN_VARIABLE,
    GitHubJob,
    JobStarted,
    canonical_repository,
)
from runner.service.jobs.spec import Submission

# Events whose workflow file, and so the action's inputs, come from a ref only the repository's writers
# control (the base or default branch, a pushed branch): a workflow's own secret bindings (the action's
# `secrets:` input) are honoured only under these. `pull_request` and its review events run the pull
# request's own workflow file, and unknown events are refused too (docs/secrets.md).
TRUSTED_WORKFLOW_EVENTS = frozenset({"pull_request_target", "push", "workflow_dispatch", "schedule", "merge_group",
                                     "workflow_run", "repository_dispatch", "release"})
MAX_JOB_TOKENS = 20_000  # jobs whose token is remembered (newest kept): a restart forgets them all
# How long a registered runner's report waits for GitHub's in_progress delivery naming the runner
# (webhooks arrive within seconds, in either order with the runner's hook).
PLACEMENT_SECONDS = 30.0


class Unauthorized(JobError):
    """A credential the service does not know (answered 401)."""


class Forbidden(JobError):
    """A caller that may not do this (answered 403); the message says what would be needed."""


class Kind(str, Enum):
    OPERATOR = "operator"
    RUNNER = "runner"
    MEMBER = "member"


@dataclass(frozen=True)
class Caller:
    kind: Kind
    who: str  # for messages and the log: "uid 1001", "runner mvc-host-1a2b"
    runner: str | None = None

    @property
    def operator(self) -> bool:
        return self.kind is Kind.OPERATOR


OPERATOR = Caller(Kind.OPERATOR, "the operator")  # in-process callers: `microvm-check run`, the webhook


def peer_ids(sock: socket.socket) -> tuple[int, int]:
    """(uid, gid) of the process at the other end of a Unix socket, as the kernel recorded them at connect."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", data)
    return uid, gid


def in_group(uid: int, gid: int, group_id: int) -> bool:
    """Whether the account `uid` belongs to `group_id` (as primary group or in /etc/group): the operator's
    `admin_group` here, and the groups the API's routes admit (the sandboxes' `sandboxes.group`)."""
    if gid == group_id:
        return True
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    return group_id in os.getgrouplist(name, gid)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


@dataclass
class _Binding:
    """The job a runner's hook reported, since when, and whether the fork guard let it run: a job the
    guard refused submits nothing, whatever its steps still try."""

    job: JobStarted
    since: float
    allowed: bool = False


class RunnerRegistry:
    """The runners by token (the fleet's, and registered ones), and the job each one's hook reported
    (runner -> current job). A registered runner's credential outlives its jobs, its binding does
    not: it ends with the job (`revoke`), or `binding_seconds` after the report. What a registered
    runner may be bound to is not its report's to say: the operator's repository in its credential,
    and with `placed_by_webhook` the run GitHub's `in_progress` delivery put on it (`place`)."""

    def __init__(self, binding_seconds: float = float("inf"), clock: Callable[[], float] = time.monotonic,
                 placed_by_webhook: bool = False, placement_seconds: float = PLACEMENT_SECONDS) -> None:
        self._lock = threading.Condition()
        self._names: dict[bytes, str] = {}
        self._jobs: dict[str, _Binding] = {}
        self._registered: dict[str, str | None] = {}  # name -> the repository the operator held it to
        self._placed: dict[str, tuple[GitHubJob, int]] = {}  # registered runner -> the job GitHub says it runs, its id
        self._ended: OrderedDict[int, None] = OrderedDict()  # ids of jobs GitHub said completed (newest kept)
        self._waiting: set[str] = set()  # registered runners whose report waits for GitHub's word
        self.binding_seconds = binding_seconds
        self.placed_by_webhook = placed_by_webhook
        self.placement_seconds = placement_seconds
        self._clock = clock

    def add(self, name: str, token: str) -> None:
        with self._lock:
            self._names[_digest(token)] = name

    def add_registered(self, name: str, credential: Credential) -> None:
        """A registered runner's credential (as `registered.load` read it)."""
        with self._lock:
            self._names[credential.digest] = name
            self._registered[name] = credential.repository

    def registered(self, name: str) -> bool:
        with self._lock:
            return name in self._registered

    def remove(self, name: str) -> None:
        """The runner ended: its token opens nothing from now on, and its binding is gone."""
        self.revoke(name)
        with self._lock:
            self._jobs.pop(name, None)

    def revoke(self, name: str) -> bool:
        """The runner's job ended (its completed hook, GitHub's `completed`): a fleet runner's token
        opens nothing from now on, whatever the runner still does (the binding stays for the fleet's
        view); a registered runner's binding ends and its credential waits for its next job. True
        when a fleet runner had a live token."""
        with self._lock:
            if name in self._registered:
                self._jobs.pop(name, None)
                return False
            kept = {digest: known for digest, known in self._names.items() if known != name}
            revoked, self._names = len(kept) != len(self._names), kept
        return revoked

    def name_for(self, token: str) -> str | None:
        if not token or len(token) > MAX_TOKEN:
            return None
        with self._lock:
            return self._names.get(_digest(token))

    def place(self, name: str, job: GitHubJob, job_id: int) -> JobStarted | None:
        """GitHub says registered runner `name` now runs `job` (a signed `in_progress` delivery of job
        `job_id`): a report of that run may bind it. A runner runs one job at a time, so a binding of
        another run has ended (its `completed` was missed or is late): it is dropped and returned, for
        the caller to end as `completed` would. A job GitHub already said completed places nothing (a
        failed delivery GitHub sends again later), and other runners' deliveries are no business of the
        registry's."""
        with self._lock:
            if name not in self._registered or job_id in self._ended:
                return None
            self._placed[name] = (job, job_id)
            self._lock.notify_all()
            held = self._jobs.get(name)
            if held is None or held.job.job.same_run(job):
                return None
            del self._jobs[name]
        return held.job

    def unplace(self, name: str, job_id: int) -> None:
        """GitHub says job `job_id` completed (on runner `name`): no report binds a runner to it any more."""
        with self._lock:
            self._ended[job_id] = None
            while len(self._ended) > MAX_JOB_TOKENS:
                self._ended.popitem(last=False)
            placed = self._placed.get(name)
            if placed is not None and placed[1] == job_id:
                del self._placed[name]

    def bind(self, name: str, job: JobStarted) -> None:
        """The runner's hook reported its job (its `job.runner` is `name`). A runner takes one job at a
        time, so the first report stands until the job ends (a registered runner's: or its binding is
        `binding_seconds` old). A registered runner's report must name a job it may be bound to
        (`_may_bind`), which it may wait for GitHub to confirm."""
        with self._lock:
            if name in self._registered:
                self._may_bind(name, job)
            now = self._clock()
            held = self._jobs.get(name)
            if held is not None and name in self._registered and now - held.since > self.binding_seconds:
                held = None
            if held is None:
                self._jobs[name] = held = _Binding(job, now)
        if held.job != job:
            raise Forbidden(f"runner {name} already reported {held.job.describe()}; a runner takes one job at a "
                            "time, and this one has not ended")

    def _may_bind(self, name: str, job: JobStarted) -> None:
        """A registered runner's report binds only a job of the repository the operator held its credential
        to, and on a service with a webhook only the run GitHub put on it; without a webhook, a credential
        that names no repository binds nothing. Called with the lock held; may wait for GitHub's word."""
        held_to = self._registered[name]
        if held_to is not None and canonical_repository(job.job.repository) != held_to:
            raise Forbidden(f"runner {name} is held to repository {held_to} by its credential (the operator's), "
                            f"but reported {job.describe()}: its jobs run as {held_to} only")
        if not self.placed_by_webhook:
            if held_to is None:
                raise Forbidden(f"runner {name} reported {job.describe()}, but this service has no webhook to say "
                                "which job GitHub gave it, and its credential names no repository to hold it to: "
                                "issue it one with `microvm-check runner credential --repository OWNER/NAME`, or "
                                "configure the webhook (workflow_job events for the runner's labels)")
            return
        placed = self._placement(name)
        if placed is None:
            raise Forbidden(f"runner {name} reported {job.describe()}, but no signed workflow_job in_progress "
                            f"delivery named runner {name} within {self.placement_seconds:g} s: the webhook must "
                            "hear workflow_job events for the runner's labels (webhook.labels), and the runner's "
                            "name on GitHub must be its credential's name")
        if not placed.same_run(job.job):
            raise Forbidden(f"runner {name} reported {job.describe()}, but GitHub says it runs "
                            f"{placed.repository} run {placed.run_id}/{placed.run_attempt}: a registered runner "
                            "is bound only to the job GitHub put on it")

    def _placement(self, name: str) -> GitHubJob | None:
        """The run GitHub says `name` runs, waiting up to `placement_seconds` for it (lock held). One
        report per runner waits at a time, so reports cannot hold the API's workers."""
        if name in self._placed:
            return self._placed[name][0]
        if name in self._waiting:
            raise Forbidden(f"runner {name} already has a report waiting for GitHub's word on its job")
        self._waiting.add(name)
        try:
            self._lock.wait_for(lambda: name in self._placed, timeout=self.placement_seconds)
        finally:
            self._waiting.discard(name)
        placed = self._placed.get(name)
        return placed[0] if placed is not None else None

    def allow(self, name: str, job: JobStarted) -> None:
        """The fork guard let `job` run: from now on its runner may submit for it."""
        with self._lock:
            held = self._jobs.get(name)
            if held is not None and held.job == job:
                held.allowed = True

    def job_of(self, name: str) -> JobStarted | None:
        with self._lock:
            held = self._jobs.get(name)
        return held.job if held is not None else None

    def allowed_job_of(self, name: str) -> tuple[JobStarted | None, bool]:
        """The runner's bound job, and whether the fork guard let it run."""
        with self._lock:
            held = self._jobs.get(name)
        return (held.job, held.allowed) if held is not None else (None, False)


class JobTokens:
    """Each job's own token (its digest), for the newest MAX_JOB_TOKENS jobs, and the fleet runner
    (if any) whose job submitted it: when that runner's job ends, its jobs' tokens go with it."""

    def __init__(self, limit: int = MAX_JOB_TOKENS) -> None:
        self._lock = threading.Lock()
        self._digests: OrderedDict[str, tuple[bytes, str | None]] = OrderedDict()
        self._limit = limit

    def issue(self, job_id: str, runner: str | None = None) -> str:
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._digests[job_id] = (_digest(token), runner)
            while len(self._digests) > self._limit:
                self._digests.popitem(last=False)
        return token

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._digests.pop(job_id, None)

    def forget_runner(self, runner: str) -> list[str]:
        """The runner's job ended: the tokens of the jobs it submitted open nothing any more."""
        with self._lock:
            gone = [job_id for job_id, (_, owner) in self._digests.items() if owner == runner]
            for job_id in gone:
                del self._digests[job_id]
        return gone

    def matches(self, job_id: str, token: str | None) -> bool:
        if not token or len(token) > MAX_TOKEN:
            return False
        with self._lock:
            expected = self._digests.get(job_id)
        return expected is not None and secrets.compare_digest(expected[0], _digest(token))


class Access:
    """The rules, applied: who a request comes from, and whether it may do what it asks."""

    def __init__(self, admin_group: str | None, fleet: bool, local_repository: str | None = None,
                 registered: dict[str, Credential] | None = None, binding_seconds: float = float("inf"),
                 placed_by_webhook: bool = False) -> None:
        self.admin_gid = _group_id(admin_group)
        self.fleet = fleet  # with runners: a socket member is no one
        self.local_repository = local_repository  # without: what a socket member's jobs run as
        self.runners = RunnerRegistry(binding_seconds, placed_by_webhook=placed_by_webhook)
        for name, credential in (registered or {}).items():
            self.runners.add_registered(name, credential)
        # A registered runner's job-completed hook ends its binding only where nothing else will (no
        # webhook): a step holds the credential as well as the hook does, and can then report only
        # jobs of the repository its credential holds it to.
        self.hook_ends_binding = not placed_by_webhook
        self.jobs = JobTokens()

    # -- who is asking ----------------------------------------------------------------------------

    def unix_caller(self, sock: socket.socket, runner_token: str | None) -> Caller:
        """A caller on the Unix socket: a runner token decides when sent (whoever sends it), else the peer's uid."""
        if runner_token is not None:
            return self._runner(runner_token)
        uid, gid = peer_ids(sock)
        if uid == 0 or (self.admin_gid is not None and in_group(uid, gid, self.admin_gid)):
            return Caller(Kind.OPERATOR, f"uid {uid} (operator)")
        return Caller(Kind.MEMBER, f"uid {uid}")

    def tcp_caller(self, runner_token: str | None) -> Caller:
        """A TCP caller got past the bearer-token gate: the operator (runners use the Unix socket)."""
        return self._runner(runner_token) if runner_token is not None else Caller(Kind.OPERATOR, "the TCP operator")

    def _runner(self, token: str) -> Caller:
        name = self.runners.name_for(token)
        if name is None:
            raise Unauthorized("the runner token is not one this service issued, or its runner has ended; "
                               "a runner's token is good for its one job only")
        return Caller(Kind.RUNNER, f"runner {name}", runner=name)

    # -- what they may do -----------------------------------------------------------------------------

    def require_operator(self, caller: Caller, what: str) -> None:
        if not caller.operator:
            raise Forbidden(f"{what} is for the operator (root or the admin_group on the socket, or the TCP token), "
                            f"not for {caller.who}")

    def require_runner(self, caller: Caller) -> str:
        if caller.runner is None:
            raise Forbidden(f"only a fleet runner (with its {RUNNER_HINT}) reports jobs, not {caller.who}")
        return caller.runner

    def admit_submit(self, caller: Caller, spec: Submission) -> str | None:
        """May `caller` submit `spec`? Returns the runner name the job belongs to (None: no fleet runner).

        A runner may only submit for the job its hook reported: same repository, run, attempt and job,
        so a workflow of repository B cannot claim A's egress policy.
        """
        if caller.operator:
            return spec.runner_name or None
        if caller.runner is None:
            if self.fleet:
                raise Forbidden(f"{caller.who} sent no runner token: on a host with a runner fleet, jobs are "
                                f"submitted by the action in a fleet runner's job, which sends its {RUNNER_HINT}")
            if self.local_repository is None:
                raise Forbidden(f"{caller.who} sent no runner credential: without one, a socket member runs local "
                                "jobs only, and this service has none configured (local_jobs.repository); a runner "
                                f"set up by `microvm-check register --service-config` sends its {RUNNER_HINT}")
            return spec.runner_name or None  # a local job: it runs as local_jobs.repository (repository_for)
        bound, allowed = self.runners.allowed_job_of(caller.runner)
        if bound is None:
            raise Forbidden(f"runner {caller.runner} has not reported a job (its job-started hook did not run), "
                            "so it may not submit one")
        if not allowed:
            raise Forbidden(f"runner {caller.runner} runs {bound.describe()}, which the fork guard did not let run "
                            "(see the job's log): it may submit nothing")
        submitted = spec.github
        if submitted is None or not submitted.same_job(bound.job):
            raise Forbidden(f"runner {caller.runner} runs {bound.describe()}, but this submit is for "
                            f"{spec.claim()}: "
                            "a job may only be submitted by the runner GitHub gave it to")
        return caller.runner

    def repository_for(self, caller: Caller, spec: Submission) -> str:
        """The repository name a job runs as (its policy, warm base, kept VMs): the one GitHub gave the
        runner, the operator's choice for a socket member's local jobs, or the operator's own."""
        if caller.runner is not None:
            bound = self.runners.job_of(caller.runner)
            if bound is not None:
                return bound.job.repository
        if not caller.operator and self.local_repository is not None:
            return self.local_repository
        return spec.repository

    def refuse_workflow_secrets(self, caller: Caller, spec: Submission, event: str) -> None:
        """A workflow's own secret bindings (the action's `secrets:` input) are honoured only when the
        workflow is the repository's trusted one: its event must run the base or default branch's
        workflow file (TRUSTED_WORKFLOW_EVENTS). A runner's event is the one its job-started hook
        reported, and the fork guard checked, before any step ran; the operator's (`microvm-check run`,
        or the action on a runner that runs as root) is the spec's own; a socket member's local jobs
        come from no workflow the service knows. Raises Forbidden saying why and what to do."""
        what = (f"the action's secrets: input ({', '.join(secret.name for secret in spec.secrets)}) is not "
                "honoured")
        if caller.runner is not None:
            bound = self.runners.job_of(caller.runner)  # its event is the one the guard checked (desk.py)
            event = bound.event if bound is not None else "(unknown)"
        elif not caller.operator:
            raise Forbidden(f"{what}: {caller.who} submits local jobs, and the service cannot tell which workflow "
                            f"sent them; a runner set up by `microvm-check register --service-config` sends its "
                            f"{RUNNER_HINT}, or ask the operator for a binding in the service's secrets file")
        elif not event:
            return  # the operator's own job (`microvm-check run`): no workflow, the operator's word
        if event not in TRUSTED_WORKFLOW_EVENTS:
            raise Forbidden(f"{what}: the job's event is {event[:60]!r}, whose workflow file (and so this input) "
                            "the pull request may have written. Bindings come only from the base branch's workflow: "
                            "trigger it with `on: pull_request_target` (or push, workflow_dispatch, schedule, "
                            "merge_group), or ask the operator for a binding in the service's secrets file "
                            "(docs/secrets.md)")

    def end_runner_job(self, runner: str, by_hook: bool = False) -> None:
        """The runner's job has ended: its token (a registered runner's binding) and its jobs' tokens
        are revoked; the operator still reaches the jobs' records. `by_hook`: the runner's own
        job-completed hook said so, which does not end a registered runner's binding where GitHub's
        `completed` will."""
        if by_hook and not self.hook_ends_binding and self.runners.registered(runner):
            return
        self.runners.revoke(runner)
        self.jobs.forget_runner(runner)

    def require_job(self, caller: Caller, job_id: str, token: str | None) -> None:
        """Reading, streaming, cancelling or uploading for a job: its own token, or the operator."""
        if caller.operator or self.jobs.matches(job_id, token):
            return
        raise Forbidden(f"job {job_id} can only be reached with the job token its submit answered "
                        f"({JOB_HINT}), or by the operator; {caller.who} sent "
                        + ("a token that is not this job's" if token else "none"))


RUNNER_HINT = f"token from {RUNNER_TOKEN_VARIABLE} in the {RUNNER_TOKEN_HEADER} header"
JOB_HINT = f"in the {JOB_TOKEN_HEADER} header"


def _group_id(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"admin_group: no group named {name!r} on this host (create it or fix the config)") from None
