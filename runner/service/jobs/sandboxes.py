"""Interactive sandboxes: live VMs that a caller drives through the job API (the `microvm_check` SDK).

A review bot or an audit agent, running as an ordinary user, creates a sandbox, runs commands in it
(output streamed back), moves files in and out and destroys it. Each sandbox is the service's, not
the caller's:
- who may create one, as which repository (whose policy store file is the most egress it may get; the
  caller's own policy only narrows it), and how many are alive at once is the operator's
  `sandboxes:` section (runner/service/config/settings.py SandboxAccess); the operator may always create;
- it has a token of its own (only its SHA-256 digest is kept, and looked up by digest), so holding
  one sandbox's token reaches nothing else, not even the same caller's other sandboxes;
- its TTL is the service's: the reaper destroys it once passed, so a caller that crashed (kill -9)
  leaks nothing; a service that died leaves it to the engine's own TTL and start-up sweep;
- it is a job record (state running while alive, its exec lines and output in its log), so the
  page, `microvm-check jobs`, the metrics and a restart's fail_unfinished see it like any job;
- every call is bounded: one exec's output and deadline, file and tar sizes, concurrent calls;
- what a call carries in and out has the shapes of the SDK's contract (microvm_check/contract.py):
  requests are read with its `from_wire` (a body it refuses is a 400 saying why), answers built as
  its records.

A snapshot of a sandbox is a template (its disk and memory as they are), a base that sandboxes of
the same caller may be created from (`base=`): a fork. It is removed once its source and every
sandbox restored from it have ended, or at the next start of a service that died first; the warm
bases' disk budget neither counts nor evicts it (its count is bounded by max_per_caller and
max_snapshots).

A hibernated sandbox (`hibernate`) is such a snapshot too, of its own: its VM is destroyed once it is made,
and `resume` restores the same sandbox (id, token, TTL) from it. It is kept while the VM resumed from it
runs (that VM's disk lies over it) and goes at the next hibernate, or with the sandbox. A parked sandbox
holds no VM but keeps its place in max_live and max_per_caller, and its disk.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

from microvm_check.contract import HIBERNATED, MAX_LISTED, MAX_PATH, CreateRequest, FileEntry, SandboxInfo, WireError
from policy.model import Policy
from runner.errors import JobError, SandboxError, SandboxOpFailed
from runner.jobapi.contract import MAX_TOKEN, JobRecord, JobState, RestoredFrom
from runner.sandbox.port import AuditRecord, SandboxFactory, SandboxLike, needs_network
from runner.service.config.settings import SandboxAccess, ServiceConfig
from runner.service.jobs.egress import EgressPolicies
from runner.service.jobs.job import LOG, vm_request
from runner.service.jobs.joblog import JobLog, LogFull
from runner.service.jobs.outputs import bounded_blocked
from runner.service.jobs.templatechoice import choose_template
from runner.tarsafe import Limits, check_tar, copy_validated

log = logging.getLogger(__name__)
Wire = TypeVar("Wire")

MAX_CALLS_PER_SANDBOX = 4  # calls at once on one sandbox: each holds an API worker while it runs
MAX_CALLS_PER_OWNER = 16  # calls at once on all of one owner's sandboxes: its share of the API's 56 workers
_REAP_SECONDS = 1.0
_TTL_MARGIN_SECONDS = 60  # the engine's own hard limit past the service's TTL, in case the service dies


class SandboxNotFound(JobError):
    """No live sandbox with this id (never created, destroyed, or its TTL passed)."""


class SandboxLimit(JobError):
    """The host's or the caller's sandbox allowance is used up (answered 429)."""

    retry_after = 10


class SandboxRefused(JobError):
    """A caller that may not create sandboxes, or a sandbox token that does not open this sandbox (403)."""


class SandboxCallError(JobError):
    """A sandbox call that cannot be made as asked; 400 with the reason. The service refused it (a path, a
    size, a deadline) or the sandbox could not do it (a missing file, a program that does not start, a
    tar it cannot unpack: SandboxOpFailed); either way the sandbox lives on."""


class SandboxStateConflict(JobError):
    """A call the sandbox's state does not allow now: a call on a hibernated sandbox, a resume of a running
    one, a hibernate while other calls are under way."""


class SandboxUnavailable(JobError):
    """The sandbox's VM did not start (a restore or its agent failed, or timed out on a busy host): the
    caller's request was fine and may be sent again (503 with Retry-After), unlike a bug of ours (500)."""

    retry_after = 5


@dataclass(frozen=True)
class Owner:
    """Who holds a sandbox, for its quota and its record: a uid on the socket, or the operator."""

    key: str  # "uid 1001", "operator"
    operator: bool = False


@dataclass(frozen=True)
class SandboxRequest:
    """A create call's body (the contract's CreateRequest), checked against this service's offer: what to
    restore from and for how long."""

    template: str
    base: str | None
    policy: str | None
    ttl_seconds: float

    @classmethod
    def parse(cls, data: object, config: ServiceConfig) -> SandboxRequest:
        wire = read_request(CreateRequest.from_wire, data)
        if wire.size is not None:
            raise SandboxCallError("size: sandboxes run at the service's default size (size classes are for jobs); "
                                   "leave it out")
        template = wire.template or config.default_template
        if template not in config.templates:
            raise SandboxCallError(f"template: {template[:80]!r} is not offered here "
                                   f"(offered: {', '.join(config.templates)})")
        limit = config.sandboxes.max_ttl_seconds
        if not 1 <= wire.ttl_seconds <= limit:
            raise SandboxCallError(f"ttl_seconds: expected a number from 1 to {limit:g} (sandboxes.max_ttl_seconds)")
        return cls(template, wire.base, wire.policy, wire.ttl_seconds)


def read_request(parse: Callable[[object], Wire], data: object) -> Wire:
    """A request body read as the contract's record by `parse` (its from_wire); one that is not is a 400."""
    try:
        return parse(data)
    except WireError as exc:
        raise SandboxCallError(str(exc)) from exc


@dataclass(frozen=True)
class Source:
    """What a new sandbox's VM is restored from (`restore`: a template, or a snapshot's), and the offered
    template it comes from (a fork's is its source's): the record says the one, the sandbox's info the other."""

    restore: str
    template: str


@dataclass
class Snapshot:
    """A template made from a sandbox, and the sandboxes that use it (its source included)."""

    name: str
    owner: Owner
    template: str  # the template its source came from (a fork's is its source's)
    users: set[str] = field(default_factory=set)
    restore_point: bool = False  # a hibernate's: its sandbox's alone to resume, never a create's base


@dataclass
class LiveSandbox:
    """One interactive sandbox: its VM, record and log; shared between API workers and the reaper."""

    id: str
    owner: Owner
    token_digest: bytes = field(repr=False)
    vm: SandboxLike  # runner.sandbox.Sandbox (the engine's), or a stand-in in tests
    record: JobRecord
    log: JobLog
    policy: Policy
    template: str  # the offered template it comes from, through `base` when it is a fork
    ttl_seconds: float
    expires: float  # monotonic
    base: str | None = None  # the snapshot it was restored from
    snapshots: list[str] = field(default_factory=list)
    calls: int = 0
    ended: str | None = None
    # Hibernation (`SandboxDesk.hibernate`): `parked` from its start until a resume has its VM; `restore_point`
    # is the snapshot its VM came from by the last hibernate (kept while that VM runs: its disk lies over it).
    parked: bool = False
    resuming: bool = False
    restore_point: str | None = None
    hibernations: int = 0
    earlier_blocked: list[AuditRecord] = field(default_factory=list)  # what its VMs before a hibernate were refused
    lock: threading.Lock = field(default_factory=threading.Lock)


class SandboxDesk:
    """The live sandboxes: created under the config's rules, found by token, reaped at their TTL."""

    def __init__(self, config: ServiceConfig, create_vm: SandboxFactory, policies: EgressPolicies,
                 save: Callable[[JobRecord], None], forget_template: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`create_vm` restores a VM from its request (the engine's `SandboxProvider.create`); `save` the
        job service's record store; and `forget_template` removes a snapshot's template (None: snapshots are
        not offered)."""
        self.config = config
        self.settings: SandboxAccess = config.sandboxes
        self._create_vm = create_vm
        self._policies = policies
        self._save = save
        self._forget_template = forget_template
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[str, LiveSandbox] = {}
        self._by_digest: dict[bytes, LiveSandbox] = {}
        self._snapshots: dict[str, Snapshot] = {}
        self._starting: dict[str, int] = {}  # owner key -> creates under way (they count against quotas)
        self._calls: dict[str, int] = {}  # owner key -> calls under way on all its sandboxes
        # each owner's share of the API's workers: all its sandboxes' calls, never past MAX_CALLS_PER_OWNER
        self.max_owner_calls = min(self.settings.max_per_caller * MAX_CALLS_PER_SANDBOX, MAX_CALLS_PER_OWNER)
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="sandbox-reaper", daemon=True)

    # -- life cycle -----------------------------------------------------------------------------------

    def start(self, leftovers: Sequence[str] = ()) -> None:
        """Serve from now on; first remove `leftovers`, the snapshot templates of a service that died
        (no sandbox outlives its service, so nothing may restore from them again)."""
        for name in leftovers:
            log.info("removing snapshot template %s: its sandboxes ended with a service that stopped", name)
            self._forget(name)
        self._reaper.start()

    def close(self) -> None:
        """Destroy every sandbox (the service is stopping); their records end cancelled."""
        self._stopping.set()
        if self._reaper.is_alive():
            self._reaper.join()
        for sandbox in self.live():
            self.end(sandbox, JobState.CANCELLED, "the service shut down")

    def live(self) -> list[LiveSandbox]:
        with self._lock:
            return list(self._by_id.values())

    # -- creating -------------------------------------------------------------------------------------

    def create(self, owner: Owner, request: SandboxRequest) -> tuple[LiveSandbox, str]:
        """A new sandbox and its token; the quota is held from the first check to the end, and so is the
        base: a snapshot whose last sandbox ends while a fork of it is being restored stays until then
        (its files removed under the restore made it fail with a 500, or run on deleted files)."""
        hold = "create-" + secrets.token_hex(8)  # a user of the base until the new sandbox is made or has failed
        source = self._source(owner, request, hold)
        try:
            policy = self._policy(request)
            self._reserve(owner)
            try:
                sandbox, token = self._start(owner, request, source, policy)
            finally:
                with self._lock:
                    self._starting[owner.key] -= 1
                    if not self._starting[owner.key]:
                        del self._starting[owner.key]
        finally:
            self._release_snapshots(hold)
        return sandbox, token

    def _source(self, owner: Owner, request: SandboxRequest, hold: str) -> Source:
        if request.base is None:
            return Source(request.template, request.template)
        with self._lock:
            snapshot = self._snapshots.get(request.base)
            if snapshot is None or snapshot.owner != owner or snapshot.restore_point:
                raise SandboxNotFound(f"base {request.base[:80]!r}: no snapshot of yours by that name (a snapshot "
                                      "lives as long as its sandbox or a sandbox restored from it)")
            snapshot.users.add(hold)
        return Source(snapshot.name, snapshot.template)

    def _policy(self, request: SandboxRequest) -> Policy:
        from runner.service.jobs.egress import EgressPolicyError

        repository = self.settings.repository
        try:
            policy = self._policies.effective(repository, request.policy)
        except EgressPolicyError as exc:
            raise SandboxCallError(str(exc)) from exc
        if needs_network(policy) and not self.config.network.enabled:
            raise SandboxCallError(f"the egress policy for {repository} allows network access, but this service runs "
                                   "VMs without networking (network.enabled is false): narrow the policy to deny all")
        return policy

    def _reserve(self, owner: Owner) -> None:
        with self._lock:
            alive = len(self._by_id) + sum(self._starting.values())
            mine = sum(1 for s in self._by_id.values() if s.owner == owner) + self._starting.get(owner.key, 0)
            if alive >= self.settings.max_live:
                raise SandboxLimit(f"this host runs its most sandboxes at once ({self.settings.max_live}, "
                                   "sandboxes.max_live); destroy one or try again later")
            if mine >= self.settings.max_per_caller:
                raise SandboxLimit(f"{owner.key} holds its most sandboxes at once ({self.settings.max_per_caller}, "
                                   "sandboxes.max_per_caller); destroy one first")
            self._starting[owner.key] = self._starting.get(owner.key, 0) + 1

    def _start(self, owner: Owner, request: SandboxRequest, source: Source,
               policy: Policy) -> tuple[LiveSandbox, str]:
        sandbox_id = "j" + secrets.token_hex(8)
        job_dir = self.config.jobs_dir / sandbox_id
        record = JobRecord(id=sandbox_id, state=JobState.STARTING, repository=self.settings.repository, sha="",
                           run_id=None, run_attempt=None, job_name="sandbox", policy_digest=policy.digest(),
                           warm=request.base is not None,
                           command=f"sandbox of {owner.key} from {source.restore}")
        job_dir.mkdir(mode=0o700)
        job_log = JobLog(job_dir / LOG, self.config.logs)
        self._save(record)
        started = time.monotonic()
        try:
            vm = self._create_vm(vm_request(self.config, choose_template(source.restore),
                                            ttl_seconds=request.ttl_seconds + _TTL_MARGIN_SECONDS, policy=policy,
                                            job_id=sandbox_id))
        except BaseException as exc:
            record.state, record.error = JobState.FAILED, f"the sandbox's VM did not start: {exc}"
            record.timings.finished_at = time.time()
            job_log.system(record.error)
            job_log.close()
            self._save(record)
            if isinstance(exc, (SandboxError, TimeoutError)):
                raise SandboxUnavailable(f"{record.error}; try again in {SandboxUnavailable.retry_after} s") from exc
            raise
        ready_ms = round((time.monotonic() - started) * 1000, 3)
        record.state, record.vm_id = JobState.RUNNING, vm.id
        record.restored_from = RestoredFrom.of_manifest(vm.template_manifest, vm.accel)
        record.timings.vm_ready_at = record.timings.started_at = time.time()
        record.timings.vm_ready_ms = ready_ms
        job_log.system(f"sandbox VM {vm.id} ready in {ready_ms:.0f} ms from {source.restore}; "
                       f"it lives at most {request.ttl_seconds:g} s")
        token = secrets.token_urlsafe(32)
        sandbox = LiveSandbox(sandbox_id, owner, _digest(token), vm, record, job_log, policy, source.template,
                              request.ttl_seconds, self._clock() + request.ttl_seconds, base=request.base)
        with self._lock:
            self._by_id[sandbox_id] = sandbox
            self._by_digest[sandbox.token_digest] = sandbox
            if request.base is not None and request.base in self._snapshots:
                self._snapshots[request.base].users.add(sandbox_id)
        self._save(record)
        return sandbox, token

    def info(self, sandbox: LiveSandbox) -> SandboxInfo:
        """What GET /v1/sandboxes/<id> and a create answer; what is left of its TTL on the reaper's clock
        (`expires` is on it, not necessarily on time.monotonic)."""
        record = sandbox.record
        state = HIBERNATED if sandbox.parked and record.vm_id is None else record.state.value
        return SandboxInfo(id=sandbox.id, template=sandbox.template, base=sandbox.base, state=state,
                           repository=record.repository, vm_id=record.vm_id, ttl_seconds=sandbox.ttl_seconds,
                           expires_in=max(0.0, round(sandbox.expires - self._clock(), 1)), accel=sandbox.vm.accel,
                           ready_ms=record.timings.vm_ready_ms)

    # -- finding --------------------------------------------------------------------------------------

    def find(self, sandbox_id: str, token: str | None, operator: bool = False) -> LiveSandbox:
        """The sandbox `token` opens, if it is `sandbox_id`; the operator needs no token."""
        with self._lock:
            sandbox = self._by_id.get(sandbox_id)
            by_token = self._by_digest.get(_digest(token)) if token and len(token) <= MAX_TOKEN else None
        if sandbox is None:
            raise SandboxNotFound(f"no live sandbox {sandbox_id[:40]!r} (destroyed, or its TTL passed)")
        if operator or (by_token is not None and secrets.compare_digest(by_token.token_digest, sandbox.token_digest)):
            return sandbox
        raise SandboxRefused(f"sandbox {sandbox_id} is reached only with the token its create answered")

    def call(self, sandbox: LiveSandbox) -> _Call:
        """Hold the sandbox for one call (at most MAX_CALLS_PER_SANDBOX at once on it, max_owner_calls on
        all its owner's sandboxes)."""
        return _Call(self, sandbox)

    def _take_call(self, owner: Owner) -> None:
        with self._lock:
            held = self._calls.get(owner.key, 0)
            if held >= self.max_owner_calls:
                raise SandboxLimit(f"{owner.key} already runs {self.max_owner_calls} sandbox calls at once "
                                   "(on all its sandboxes); wait for one")
            self._calls[owner.key] = held + 1

    def _give_call(self, owner: Owner) -> None:
        with self._lock:
            left = self._calls.get(owner.key, 1) - 1
            if left:
                self._calls[owner.key] = left
            else:
                self._calls.pop(owner.key, None)

    # -- ending ---------------------------------------------------------------------------------------

    def end(self, sandbox: LiveSandbox, state: JobState, why: str) -> bool:
        """Destroy the sandbox's VM and finish its record (idempotent); False when it had ended already."""
        with self._lock:
            if sandbox.ended is not None:
                return False
            sandbox.ended = why
            self._by_id.pop(sandbox.id, None)
            self._by_digest.pop(sandbox.token_digest, None)
        self.note_blocked(sandbox)  # before the destroy: the VM's network slot, and its audit records, go with it
        try:
            sandbox.vm.destroy()
        except Exception:
            log.exception("sandbox %s: destroying VM %s failed (the engine's TTL remains)", sandbox.id, sandbox.record.vm_id)
        record = sandbox.record
        record.state, record.timings.finished_at = state, time.time()
        if state is JobState.FINISHED:
            record.exit_code = 0
        else:
            record.error = why
        sandbox.log.system(f"sandbox ends: {why}")
        sandbox.log.close()
        self._save(record)
        self._release_snapshots(sandbox.id)
        return True

    def note_blocked(self, sandbox: LiveSandbox) -> None:
        """What the guest tried that its policy refused, into the record (the page shows it)."""
        try:
            blocked = bounded_blocked([*sandbox.earlier_blocked, *sandbox.vm.blocked_egress()])
        except Exception:  # a VM that is gone has nothing more to say
            return
        if blocked and blocked != sandbox.record.blocked_egress:  # a slot that went says nothing: keep what was seen
            sandbox.record.blocked_egress = blocked
            if not sandbox.record.final:
                self._save(sandbox.record)

    def reap(self) -> list[str]:
        """End every sandbox whose TTL has passed, whatever its caller is doing; their ids."""
        now = self._clock()
        expired = [s for s in self.live() if s.expires <= now]
        for sandbox in expired:
            self.end(sandbox, JobState.TIMED_OUT, "its TTL passed: the service destroyed it")
        return [s.id for s in expired]

    def _reap_loop(self) -> None:
        while not self._stopping.wait(_REAP_SECONDS):
            try:
                self.reap()
            except Exception:
                log.exception("the sandbox reaper's pass failed; it runs again in %g s", _REAP_SECONDS)

    # -- snapshots --------------------------------------------------------------------------------------

    def snapshot(self, sandbox: LiveSandbox) -> str:
        """A template of the sandbox as it is now, for `create(base=...)` by the same owner."""
        if self._forget_template is None:
            raise SandboxCallError("this service offers no snapshots (it runs no VM engine of its own)")
        if len(sandbox.snapshots) >= self.settings.max_snapshots:
            raise SandboxLimit(f"sandbox {sandbox.id} made its most snapshots ({self.settings.max_snapshots}, "
                               "sandboxes.max_snapshots)")
        name = f"sbx-{sandbox.id}-{len(sandbox.snapshots) + 1}"
        snap = Snapshot(name, sandbox.owner, sandbox.template, {sandbox.id})
        with self._lock:
            self._snapshots[name] = snap
            sandbox.snapshots.append(name)
        try:
            sandbox.vm.snapshot(name, extra={"sandbox": sandbox.id})
        except BaseException as exc:
            with self._lock:
                self._snapshots.pop(name, None)
                sandbox.snapshots.remove(name)  # a snapshot that was not made counts against no limit
            self._forget(name)
            if isinstance(exc, (SandboxError, OSError)) and sandbox.vm.alive:
                # the host could not make it (a migration timed out on a busy host, a full disk): no bug
                # of ours and no fault of the caller's; its sandbox runs on (a VM that died: _Call's 404)
                raise SandboxUnavailable(f"the snapshot of sandbox {sandbox.id} failed on the host ({exc}); the "
                                         f"sandbox runs on: try again in {SandboxUnavailable.retry_after} s") from exc
            raise
        if sandbox.ended is not None:  # ended while it was made: its end may have released it before it was
            self._forget_released(name)  # published
            raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}")
        sandbox.log.system(f"snapshot {name} made")
        return name

    # -- hibernation -------------------------------------------------------------------------------------

    def hibernate(self, sandbox: LiveSandbox) -> None:
        """Park the sandbox: its VM snapshotted (memory and disk) into a template of its own, then destroyed,
        so it holds no CPU and no RAM until `resume`. Its id, token, TTL and place in the quotas stay; its
        calls are refused meanwhile, and the reaper ends it at its TTL like a running one."""
        if self._forget_template is None:
            raise SandboxCallError("this service offers no hibernation (it runs no VM engine of its own)")
        with sandbox.lock:
            if sandbox.ended is not None:
                raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}")
            if sandbox.parked:
                raise SandboxStateConflict(f"sandbox {sandbox.id} is hibernated already, or being hibernated or resumed")
            if sandbox.calls:
                raise SandboxStateConflict(f"sandbox {sandbox.id} has {sandbox.calls} call(s) under way; hibernate it "
                                           "once they have ended")
            sandbox.parked = True  # from here its calls are refused
        name = f"sbx-{sandbox.id}-h{sandbox.hibernations + 1}"
        with self._lock:
            self._snapshots[name] = Snapshot(name, sandbox.owner, sandbox.template, {sandbox.id}, restore_point=True)
        try:
            # not pooled: a restore point is restored once, and a spare VM of it would run the guest on, unasked
            sandbox.vm.snapshot(name, extra={"sandbox": sandbox.id, "pooled": False})
        except BaseException as exc:
            with self._lock:
                self._snapshots.pop(name, None)
            self._forget(name)
            with sandbox.lock:
                sandbox.parked = False
            if isinstance(exc, (SandboxError, OSError)) and sandbox.vm.alive:
                raise SandboxUnavailable(f"hibernating sandbox {sandbox.id} failed on the host ({exc}); it runs on: "
                                         f"try again in {SandboxUnavailable.retry_after} s") from exc
            if not sandbox.vm.alive:
                self.end(sandbox, JobState.FAILED, f"its VM failed while it was being hibernated: {exc}")
                raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}") from exc
            raise
        self.note_blocked(sandbox)  # before the destroy, as at its end
        vm_id = sandbox.record.vm_id
        try:
            sandbox.vm.destroy()
        except Exception:  # as at its end: the engine's TTL remains; the sandbox is parked all the same
            log.exception("sandbox %s: destroying VM %s after its hibernate failed", sandbox.id, vm_id)
        with self._lock:  # end() decides under this lock
            gone = sandbox.ended
            if gone is None:
                previous, sandbox.restore_point = sandbox.restore_point, name
                sandbox.hibernations += 1
                sandbox.earlier_blocked = list(sandbox.record.blocked_egress)
                sandbox.record.vm_id = None
        if gone is not None:  # destroyed or reaped meanwhile: its end saved the record, and may have released
            self._forget_released(name)  # the snapshot before it was published
            raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {gone}")
        if previous is not None:  # the VM restored from it is gone: nothing lies over it any more
            self._release_snapshots(sandbox.id, only=previous)
        self._save(sandbox.record)
        sandbox.log.system(f"hibernated: VM {vm_id} snapshotted as {name} and destroyed")

    def resume(self, sandbox: LiveSandbox) -> None:
        """A hibernated sandbox's VM, restored from its last hibernate where it was (its files and processes;
        a fresh random seed and the host's clock, as every restore), for what is left of its TTL."""
        with sandbox.lock:
            if sandbox.ended is not None:
                raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}")
            if not sandbox.parked or sandbox.restore_point is None or sandbox.record.vm_id is not None:
                raise SandboxStateConflict(f"sandbox {sandbox.id} is not hibernated (or is being hibernated)")
            if sandbox.resuming:
                raise SandboxStateConflict(f"sandbox {sandbox.id} is being resumed already")
            sandbox.resuming = True
            point = sandbox.restore_point
        hold = "resume-" + secrets.token_hex(8)  # as a create holds its base: an end meanwhile removes it after
        with self._lock:
            snap = self._snapshots.get(point)
            if snap is not None:
                snap.users.add(hold)
        if snap is None:  # its end released it just now
            with sandbox.lock:
                sandbox.resuming = False
            raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}")
        try:
            vm = self._restore(sandbox, point)
        finally:
            self._release_snapshots(hold)
        record = sandbox.record
        record.restored_from = RestoredFrom.of_manifest(vm.template_manifest, vm.accel)
        self._save(record)
        sandbox.log.system(f"resumed: VM {vm.id} ready in {vm.ready_ms:.0f} ms from {point}")

    def _restore(self, sandbox: LiveSandbox, point: str) -> SandboxLike:
        """`resume`'s VM, handed to the sandbox unless it ended meanwhile (then destroyed, and a 404)."""
        left = max(1.0, sandbox.expires - self._clock())
        try:
            vm = self._create_vm(vm_request(self.config, choose_template(point), ttl_seconds=left + _TTL_MARGIN_SECONDS,
                                            policy=sandbox.policy, job_id=sandbox.id))
        except BaseException as exc:
            with sandbox.lock:
                sandbox.resuming = False
            if sandbox.ended is not None:
                raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}") from exc
            if isinstance(exc, (SandboxError, TimeoutError)):
                raise SandboxUnavailable(f"resuming sandbox {sandbox.id} failed on the host ({exc}); it stays "
                                         f"hibernated: try again in {SandboxUnavailable.retry_after} s") from exc
            raise
        with self._lock:  # end() decides under this lock: either it sees this VM, or this sees it ended
            gone = sandbox.ended
            if gone is None:
                sandbox.vm, sandbox.record.vm_id = vm, vm.id
                with sandbox.lock:
                    sandbox.parked = sandbox.resuming = False
        if gone is not None:
            vm.destroy()
            raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {gone}")
        return vm

    def _release_snapshots(self, user: str, only: str | None = None) -> None:
        """`user` (a sandbox, or a create under way) no longer needs its snapshots (or the one named `only`):
        remove those left unused."""
        with self._lock:
            unused = []
            for snap in list(self._snapshots.values()):
                if only is not None and snap.name != only:
                    continue
                snap.users.discard(user)
                if not snap.users:
                    unused.append(self._snapshots.pop(snap.name).name)
        for name in unused:
            self._forget(name)

    def _forget_released(self, name: str) -> None:
        """Remove snapshot `name` if no sandbox or create holds it any more (a release that came before its
        template was published could not remove it)."""
        with self._lock:
            held = name in self._snapshots
        if not held:
            self._forget(name)

    def _forget(self, name: str) -> None:
        if self._forget_template is None:
            return
        try:
            self._forget_template(name)
        except Exception:
            log.exception("removing snapshot template %s failed", name)


class _Call:
    """One call on a sandbox: counted against its concurrency, refused once it has ended, and its
    sandbox's failures turned into the API's refusals (see `__exit__`)."""

    def __init__(self, desk: SandboxDesk, sandbox: LiveSandbox) -> None:
        self.desk, self.sandbox = desk, sandbox

    def __enter__(self) -> LiveSandbox:
        sandbox = self.sandbox
        with sandbox.lock:
            if sandbox.ended is not None:
                raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}")
            if sandbox.parked:
                raise SandboxStateConflict(f"sandbox {sandbox.id} is hibernated: resume it first (Sandbox.resume)")
            if sandbox.calls >= MAX_CALLS_PER_SANDBOX:
                raise SandboxLimit(f"sandbox {sandbox.id} already runs {MAX_CALLS_PER_SANDBOX} calls; wait for one")
            self.desk._take_call(sandbox.owner)
            sandbox.calls += 1
        return sandbox

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        """A failure the sandbox lives through (SandboxOpFailed) leaves as SandboxCallError, a 400 with the
        guest's (or the host unpacker's) reason; one that ended the VM ends the sandbox and leaves as
        SandboxNotFound saying why. Neither is a bug of the service's: no 500, no traceback in its log."""
        sandbox = self.sandbox
        with sandbox.lock:
            sandbox.calls -= 1
        self.desk._give_call(sandbox.owner)
        if exc is not None and not sandbox.vm.alive:  # the call's failure ended the VM
            gone = isinstance(exc, (ConnectionError, TimeoutError))
            self.desk.end(sandbox, JobState.CANCELLED if gone else JobState.FAILED,
                          "its caller went away in the middle of an exec" if gone else f"its VM failed: {exc}")
            if isinstance(exc, SandboxError):
                raise SandboxNotFound(f"sandbox {sandbox.id} has ended: {sandbox.ended}") from exc
        elif isinstance(exc, SandboxOpFailed):
            raise SandboxCallError(str(exc)) from exc


def guest_path(value: str | None, what: str = "path") -> str:
    """An absolute guest path as a call may name it: no NUL, bounded (the guest resolves it in its own tree)."""
    if not value or not value.startswith("/") or "\0" in value or len(value) > MAX_PATH:
        raise SandboxCallError(f"{what}: expected an absolute path in the sandbox (at most {MAX_PATH} characters)")
    return value


def spool_tar(chunks: Iterator[bytes], path: Path, max_bytes: int) -> None:
    """An uploaded tar into `path`, bounded, then checked by the safe tar code before the guest gets it."""
    written = 0
    try:
        with open(path, "wb") as out:
            for chunk in chunks:
                written += len(chunk)
                if written > max_bytes:
                    raise SandboxCallError(f"the upload is larger than {max_bytes} bytes (sandboxes.file_max_bytes)")
                out.write(chunk)
        with open(path, "rb") as check:
            check_tar(check)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def clean_download(raw: BinaryIO, out: BinaryIO, max_bytes: int, globs: list[str]) -> list[tuple[str, str]]:
    """The guest's tar re-written with only acceptable regular files (tarsafe.copy_validated); what was skipped."""
    copied = copy_validated(raw, out, Limits(max_file_bytes=max_bytes, max_total_bytes=max_bytes),
                            stop_names=globs)
    return list(copied.skipped)


def parse_listing(output: bytes) -> list[FileEntry]:
    """`find -printf '%y %s %P\\0'` output from the guest into entries, bounded and checked."""
    kinds = {"f": "file", "d": "dir", "l": "link"}
    entries: list[FileEntry] = []
    for item in output.split(b"\0")[:MAX_LISTED]:
        kind, _, rest = item.partition(b" ")
        size, _, name = rest.partition(b" ")
        if not name or not size.isdigit() or len(size) > 20:
            continue
        entries.append(FileEntry(name.decode("utf-8", "replace")[:MAX_PATH],
                                 kinds.get(kind.decode("ascii", "replace"), "other"), int(size)))
    return entries


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def log_output(job_log: JobLog) -> Callable[[str, bytes], None]:
    """Guest output into the sandbox's log until its budget is full; then the log says so and stops."""
    full = False

    def write(stream: str, data: bytes) -> None:
        nonlocal full
        if full:
            return
        try:
            job_log.append(stream, data)
        except LogFull:
            full = True
    return write
