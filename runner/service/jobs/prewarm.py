"""Pre-warmed VMs: restored when GitHub says a job is queued, claimed when its submit arrives.

A pre-warmed VM is bound to one (repository, run_id, run_attempt), its template and the policy it was
created with: a submit may only claim it if its effective policy has the same digest, since a VM's
egress is fixed at creation, and if the service would restore the job from the same template (both
ask `choose_template`, runner/service/jobs/templatechoice.py). The template is chosen in the background
with the restore, since choosing a base may ask GitHub whether it is current and the webhook must
answer at once. Unclaimed VMs expire and are destroyed; the pool is bounded,
counting VMs still being restored.

Four things are called warm, and this module is one: pre-warmed VMs (one announced job each, here);
spare VMs (runner/vm/pool.py `SpareVMs`, the engine's, restored ahead for no job in particular); warm
bases (runner/service/jobs/bases.py, a repository's template with its dependencies installed); and the
`warm:` section of a repository's file that asks for one (policy/warm.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from runner.jobapi.contract import GitHubJob
from runner.sandbox.port import SandboxLike, TemplateChoice

log = logging.getLogger(__name__)


@dataclass
class PrewarmedVM:
    key: GitHubJob  # the job GitHub announced (its run is what a submit must match)
    github_job_id: int
    policy_digest: str
    expires_at: float
    template: str | None = None  # None until chosen, just before the restore
    sandbox: SandboxLike | None = None  # None while it is being restored
    discarded: bool = False
    ready: threading.Event = field(default_factory=threading.Event)


class PrewarmedVMs:
    """VMs restored for one announced job each, claimed by its submit (the engine's `SpareVMs` are
    another thing: restored ahead of time for no job in particular)."""

    def __init__(self, max_vms: int, expire_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_vms = max_vms
        self.expire_seconds = expire_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._vms: list[PrewarmedVM] = []
        self._closed = False

    def prewarm(self, key: GitHubJob, github_job_id: int, policy_digest: str, choose: Callable[[], TemplateChoice],
                create: Callable[[TemplateChoice], SandboxLike]) -> bool:
        """In the background, choose the template (`choose()`) and restore a VM from it (`create(choice)`);
        False when the pool is full or closed."""
        with self._lock:
            if self._closed or len(self._vms) >= self.max_vms:
                return False
            if any(vm.github_job_id == github_job_id and vm.key.same_run(key) for vm in self._vms):
                return False  # GitHub redelivers webhooks; one VM per job is enough
            vm = PrewarmedVM(key, github_job_id, policy_digest, self._clock() + self.expire_seconds)
            self._vms.append(vm)
        threading.Thread(target=self._restore, args=(vm, choose, create), name=f"prewarm-{github_job_id}",
                         daemon=True).start()
        return True

    def _restore(self, vm: PrewarmedVM, choose: Callable[[], TemplateChoice],
                 create: Callable[[TemplateChoice], SandboxLike]) -> None:
        try:
            choice = choose()
            with self._lock:
                vm.template = choice.template
            sandbox = create(choice)
        except Exception:
            log.warning("pre-warming a VM for %s failed", vm.key.describe(), exc_info=True)
            with self._lock:
                self._forget(vm)
            vm.ready.set()
            return
        with self._lock:
            vm.sandbox = sandbox
            unwanted = vm.discarded or self._closed
            if unwanted:
                self._forget(vm)
        vm.ready.set()
        if unwanted:
            _destroy(sandbox)

    def claim(self, key: GitHubJob, template: str, policy_digest: str) -> SandboxLike | None:
        """A ready VM for this run with the same template and policy, now owned by the caller; or None."""
        with self._lock:
            for vm in self._vms:
                if (vm.key.same_run(key) and vm.template == template and vm.policy_digest == policy_digest
                        and vm.sandbox is not None):
                    self._forget(vm)  # claimed: no longer the pool's to expire or discard
                    return vm.sandbox
        return None

    def discard_job(self, key: GitHubJob, github_job_id: int) -> int:
        """Destroy the unclaimed VMs warmed for one GitHub job (it completed or was cancelled)."""
        return self._discard(lambda vm: vm.key.same_run(key) and vm.github_job_id == github_job_id)

    def expire(self) -> int:
        now = self._clock()
        return self._discard(lambda vm: vm.expires_at <= now)

    def close(self, wait_seconds: float = 30.0) -> None:
        """Destroy every unclaimed VM, including those still being restored once they are."""
        with self._lock:
            self._closed = True
            pending = [vm for vm in self._vms if vm.sandbox is None]
        self._discard(lambda vm: True)
        for vm in pending:
            vm.ready.wait(wait_seconds)

    def count(self) -> int:
        with self._lock:
            return len(self._vms)

    def _discard(self, match: Callable[[PrewarmedVM], bool]) -> int:
        with self._lock:
            chosen = [vm for vm in self._vms if match(vm)]
            ready = [vm.sandbox for vm in chosen if vm.sandbox is not None]
            for vm in chosen:
                vm.discarded = True  # one still restoring is destroyed by _restore when it is ready
                if vm.sandbox is not None:
                    self._forget(vm)
        for sandbox in ready:
            _destroy(sandbox)
        return len(chosen)

    def _forget(self, vm: PrewarmedVM) -> None:
        if vm in self._vms:
            self._vms.remove(vm)


def _destroy(sandbox: SandboxLike) -> None:
    try:
        sandbox.destroy()
    except Exception:
        log.exception("destroying pre-warmed VM %s failed", sandbox.id)
