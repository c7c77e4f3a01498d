"""Warm bases per repository: the bare template with a repository's dependencies already installed.

A repository whose trusted file (`policy.warm`: the operator's store file, or the default branch's
`.github/microvm-check.yml`; never a pull request) has a `warm:` section gets a template of its
own per network variant, `<template>--<net|nonet>--<owner>--<repo>`: the default branch's files
(GitHub's tarball) are put in a VM restored from the bare template, `setup` runs there, and the VM
is snapshotted (`Sandbox.snapshot`). A restore needs exactly the template's devices, so a job that
needs a network card and one that must have none each get a base of their own variant, built when
a job first needs it: a base of one variant never serves the other. The setup of a `net` base
runs with the section's egress; that of a `nonet` base has no network at all. The base is keyed by the bare template's digest and the git blob
shas of the input files, so the contents API's directory listings tell whether it is stale
without downloading anything.

A job of the repository restores from its base. When the base is stale (an input changed on the
default branch, or the bare template was rebuilt) the job takes the last good base, or the bare
template when there is none, and the rebuild runs beside it, one per base at a time (a push to
the default branch starts one too, `pushed`). A pull
request's own files never reach a base: whatever it changes, it runs on the default branch's base
and installs what it needs on top. Bases are held to a disk budget, least recently used first.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from policy import PolicyError, PolicyStore, load_repository_file
from policy.model import Policy
from policy.warm import RepositoryFile, WarmSpec
from runner.github.errors import GitHubError
from runner.github.policy_source import PolicySource, input_blobs, tarball
from runner.jobapi.contract import canonical_repository
from runner.sandbox.port import SandboxLike, VMRequest
from runner.service.config.settings import ServiceConfig
from runner.vm.errors import SandboxError
from runner.vm.templates import Template, TemplateNotFound

if TYPE_CHECKING:
    from runner.sandbox.port import SandboxProvider

log = logging.getLogger(__name__)

MAX_MEMBERS = 200_000
DAY_SECONDS = 86400.0  # the longest back-off of a failing base


class BaseBuildError(SandboxError):
    """A warm base could not be built; jobs go on with the last good base or the bare template."""


@dataclass(frozen=True)
class BaseSettings:
    """What the service config says about bases (its `bases:` section), and the bare template."""

    parent: str  # the bare template every base starts from (the service's default template)
    budget_bytes: int
    setup_timeout_s: float
    max_checkout_bytes: int  # the default branch's tarball, like a job's checkout
    max_concurrent_builds: int = 1  # on the host at once: the rest wait (a template change makes every base stale)
    failure_backoff_s: float = 300.0  # a failed build is not retried sooner; doubled per failure in a row

    @classmethod
    def from_config(cls, config: ServiceConfig) -> BaseSettings:
        return cls(parent=config.default_template, budget_bytes=config.bases.disk_budget,
                   setup_timeout_s=config.bases.setup_timeout_seconds, max_checkout_bytes=config.checkout_max_bytes,
                   max_concurrent_builds=config.bases.max_concurrent_builds,
                   failure_backoff_s=config.bases.failure_backoff_seconds)


def variant_of(network: bool) -> str:
    return "net" if network else "nonet"


def base_name(parent: str, repository: str, network: bool) -> str:
    """`<parent>--<variant>--<owner>--<repo>`: unambiguous, as a recipe template's name and an owner
    name never hold two hyphens in a row, and the variant is one of two words."""
    owner, _, repo = canonical_repository(repository).partition("/")
    return f"{parent}--{variant_of(network)}--{owner}--{repo}"


def inputs_key(parent_digest: str, blobs: dict[str, str]) -> str:
    """The base's digest: the bare template's, and each input file's path and git blob sha."""
    text = json.dumps([parent_digest, sorted(blobs.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class RepositoryBases:
    """Which template a repository's jobs restore from, and the (re)builds of their bases.

    `sandboxes` is the service's VM engine as a provider (its sandboxes, templates and spare VMs),
    `warm_for` the repository's `warm:` section and setup policy (`PolicyStore.warm_for` with the default
    branch as fallback), `github` the App's client for the default branch's files."""

    def __init__(self, sandboxes: SandboxProvider, warm_for: Callable[[str], tuple[WarmSpec, Policy] | None],
                 github: PolicySource, settings: BaseSettings) -> None:
        self.sandboxes = sandboxes
        self._warm_for = warm_for
        self.github = github
        self.settings = settings
        self._building: dict[tuple[str, bool], threading.Thread] = {}
        self._again: set[tuple[str, bool]] = set()  # asked for while building: build once more after
        self._locks: dict[tuple[str, bool], threading.Lock] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._building_in: set[SandboxLike] = set()  # the VMs builds run in now, so close() can end them
        self._turns = threading.BoundedSemaphore(settings.max_concurrent_builds)  # the host's cap on builds
        self._failed: dict[tuple[str, bool], tuple[int, float]] = {}  # failures in a row, no retry before
        self.clock: Callable[[], float] = time.monotonic

    # -- for jobs ------------------------------------------------------------------------------------

    def template_for(self, repository: str, network: bool) -> str:
        """The template a job of `repository` restores from now: its base of the job's variant, fresh
        or last good; else the bare template. A stale or missing base is rebuilt beside."""
        parent = self.settings.parent
        try:
            warm = self._warm_for(repository)
            if warm is None:
                return parent
            fresh = self._fresh_digest(repository, warm[0])
        except (GitHubError, PolicyError, SandboxError, TemplateNotFound, ValueError) as exc:
            log.warning("warm base of %s: cannot tell whether it is current (%s); jobs use what there is", repository, exc)
            fresh = None
        if network and not self.sandboxes.networked:
            return parent  # this engine makes no networked VMs: nothing to build, the job fails as it would
        name = base_name(parent, repository, network)
        current = self._current(name)
        if current is None or current.digest != fresh:
            self.rebuild_beside(repository, network)
        if current is None or variant_of(network) not in current.variants:
            return parent  # never the other variant's base: a restore must have the template's devices
        return name

    def pushed(self, repository: str, commit: str) -> list[bool]:
        """A push says the default branch moved (to `commit`): rebuild the bases the repository has
        (each variant built so far) beside the jobs, which keep the last good base meanwhile. A
        repository without a base has nothing to mark stale: its first job builds the variant it needs.

        The build is of the default branch's head as GitHub reports it now (its tarball names the
        commit), never of the commit the delivery names: a signed push replayed after the delivery log
        forgot it, or one delivered late, must not roll a base back to a commit the branch has left,
        and a build from the current head is a no-op when the base already holds it."""
        variants = [network for network in (False, True)
                    if self._current(base_name(self.settings.parent, repository, network)) is not None]
        for network in variants:
            self.rebuild_beside(repository, network)
        if variants:
            log.info("push to %s's default branch (%s): rebuilding from the branch's current head", repository,
                     commit[:12])
        return variants

    def rebuild_beside(self, repository: str, network: bool, ref: str | None = None) -> bool:
        """Start building the repository's base of one variant in the background; when a build of it
        already runs, it runs once more after (the branch may have moved since it started)."""
        key = (repository, network)
        with self._lock:
            if self._closed:
                return False
            running = self._building.get(key)
            if running is not None and running.is_alive():
                self._again.add(key)
                return False
            _, not_before = self._failed.get(key, (0, 0.0))
            if self.clock() < not_before:
                return False  # its setup failed lately: jobs use what there is until the back-off ends
            thread = threading.Thread(target=self._build_logged, args=(repository, network, ref),
                                      name=f"base-{repository}-{variant_of(network)}", daemon=True)
            self._building[key] = thread
        thread.start()
        return True

    def wait(self, repository: str, network: bool = False, timeout: float | None = None) -> None:
        """Wait for a background build of the repository's base (tests, benchmarks)."""
        with self._lock:
            thread = self._building.get((repository, network))
        if thread is not None:
            thread.join(timeout)

    def evict(self, keep: frozenset[str] = frozenset()) -> list[str]:
        """Hold the bases (and other derived templates) to the disk budget, least recently used first."""
        gone = self.sandboxes.evict(self.settings.budget_bytes, keep=keep)
        for name in gone:
            log.info("removed the warm base %s: over the bases' disk budget of %d bytes", name,
                     self.settings.budget_bytes)
        return gone

    # -- building ------------------------------------------------------------------------------------

    def build(self, repository: str, network: bool = False, ref: str | None = None) -> Template | None:
        """Build the repository's base of one variant from its default branch (or `ref`, a commit of
        it) now, unless the current one is already that; None when the repository has no `warm:`."""
        warm = self._warm_for(repository)
        if warm is None:
            return None
        spec, setup_policy = warm
        name = base_name(self.settings.parent, repository, network)
        with self._repository_lock(repository, network):
            ref = ref or self.github.default_branch(repository)
            parent = self.sandboxes.template(self.settings.parent)
            current = self._current(name)
            if current is not None and current.digest == self._digest_at(repository, spec, parent.digest, ref):
                return current  # the listings say so: nothing to download
            archive = tarball(self.github.client, repository, ref, self.settings.max_checkout_bytes)
            checkout, blobs, commit = restream(archive, spec.inputs, self.settings.max_checkout_bytes)
            digest = inputs_key(parent.digest, blobs)
            if current is not None and current.digest == digest:
                return current
            log.info("building the %s warm base of %s at %s (%s)", variant_of(network), repository, commit or ref,
                     digest)
            template = self._setup_and_snapshot(repository, name, network, digest, spec, setup_policy, checkout,
                                                {"repository": repository, "commit": commit, "inputs": blobs})
        self.evict(keep=frozenset({name}))
        if current is not None:  # the base was in use: its spare VMs are of the old build; start new ones
            self.sandboxes.refill(template, network)
        return template

    def _setup_and_snapshot(self, repository: str, name: str, network: bool, digest: str, spec: WarmSpec,
                            setup_policy: Policy, checkout: bytes, extra: dict[str, object]) -> Template:
        sandbox = self.sandboxes.create(VMRequest(template=self.settings.parent, policy=setup_policy if network else None,
                                                  job_id=f"warm-{name}"[:60], network_card=network))
        with self._lock:
            self._building_in.add(sandbox)
            closed = self._closed
        try:
            if closed:
                raise BaseBuildError("the service is shutting down")
            sandbox.put_tar(io.BytesIO(checkout))
            output = bytearray()

            def keep_tail(stream: str, data: bytes) -> None:
                output.extend(data)
                del output[:-4000]

            result = sandbox.exec(spec.setup, timeout_seconds=self.settings.setup_timeout_s, on_output=keep_tail,
                                  capture_bytes=0)
            if result.exit_code != 0:
                offline = "" if network else (" (a base for jobs without a network card: its setup had no network, "
                                              "whatever warm.policy allows)")
                raise BaseBuildError(f"the warm setup of {repository} failed (exit {result.exit_code}"
                                     f"{', timed out' if result.timed_out else ''}){offline}; its output ended with:\n"
                                     f"{output.decode(errors='replace')[-2000:]}")
            sandbox.snapshot(name, digest=digest, extra={"base": extra})
        finally:
            with self._lock:
                self._building_in.discard(sandbox)
            sandbox.destroy()
        template = self._current(name)
        if template is None:
            raise BaseBuildError(f"the snapshot of {repository}'s warm base {name} is not in the template store")
        return template

    def close(self, timeout: float = 30.0) -> None:
        """Stop building: no new builds, the VMs running a setup are destroyed (so their builds fail at
        once instead of running minutes into a closing engine), and the build threads are joined."""
        with self._lock:
            self._closed = True
            running = list(self._building_in)
            threads = list(self._building.values())
        for sandbox in running:
            sandbox.destroy()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _build_logged(self, repository: str, network: bool, ref: str | None) -> None:
        key = (repository, network)
        while True:
            try:
                with self._turns:  # the host's cap: a build waits here for its turn
                    if self._closed:
                        return
                    self.build(repository, network, ref)
                with self._lock:
                    self._failed.pop(key, None)
            except Exception as exc:
                if self._closed:
                    log.info("warm base of %s (%s): build stopped by shutdown", repository, variant_of(network))
                    return
                wait = self._back_off(key)
                log.warning("warm base of %s (%s): the build failed: %s; not tried again for %.0f s", repository,
                            variant_of(network), exc, wait)
            with self._lock:
                if self._closed or key not in self._again:
                    return
                self._again.discard(key)
            ref = None  # asked again meanwhile: build what the default branch holds now

    def _back_off(self, key: tuple[str, bool]) -> float:
        """Note one more failure in a row of this base's build: the seconds before it is tried again."""
        with self._lock:
            failures = self._failed.get(key, (0, 0.0))[0] + 1
            wait = min(self.settings.failure_backoff_s * 2.0 ** min(failures - 1, 16), DAY_SECONDS)
            self._failed[key] = (failures, self.clock() + wait)
            self._again.discard(key)  # a failed build is not run again at once because a job asked meanwhile
        return wait

    def _fresh_digest(self, repository: str, spec: WarmSpec) -> str:
        parent = self.sandboxes.template(self.settings.parent)
        return self._digest_at(repository, spec, parent.digest, self.github.default_branch(repository))

    def _digest_at(self, repository: str, spec: WarmSpec, parent_digest: str, ref: str) -> str:
        return inputs_key(parent_digest, input_blobs(self.github.client, repository, spec.inputs, ref))

    def _current(self, name: str) -> Template | None:
        return self.sandboxes.find_template(name)

    def _repository_lock(self, repository: str, network: bool) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault((repository, network), threading.Lock())


def branch_warm(store: PolicyStore, github: PolicySource | None) -> Callable[[str], tuple[WarmSpec, Policy] | None]:
    """`warm_for` from the policy store, falling back to the default branch's file via the App."""
    def fallback(repository: str) -> RepositoryFile | None:
        if github is None:
            return None
        found = github.for_repository(repository)
        return None if found is None else load_repository_file(found.text, found.provenance.describe())

    return lambda repository: store.warm_for(repository, lambda: fallback(repository))


def restream(archive: bytes, inputs: tuple[str, ...], max_bytes: int) -> tuple[bytes, dict[str, str], str | None]:
    """GitHub's tarball as a plain tar of the checkout (its top directory stripped), the input files'
    git blob shas and the commit (from the pax global header). The result goes through the
    checkout's own hardened unpacking (`Sandbox.put_tar`); here sizes and names are only bounded."""
    from runner.github.policy_source import _matches

    out = io.BytesIO()
    blobs: dict[str, str] = {}
    total = members = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as source, \
                tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as sink:
            commit = source.pax_headers.get("comment")
            for member in source:
                members += 1
                total += member.size
                if members > MAX_MEMBERS or total > max_bytes:
                    raise BaseBuildError(f"the default branch's tarball holds more than {MAX_MEMBERS} files or "
                                         f"{max_bytes} bytes")
                _, _, name = member.name.partition("/")
                if not name:
                    continue  # the top directory itself
                data = _read(source.extractfile(member)) if member.isreg() else None
                if data is not None and any(_matches(name, p) for p in inputs):
                    blobs[name] = git_blob_sha(data)
                member.name = name
                if member.islnk():
                    member.linkname = member.linkname.partition("/")[2]
                sink.addfile(member, io.BytesIO(data) if data is not None else None)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BaseBuildError(f"the default branch's tarball does not read: {exc}") from None
    return out.getvalue(), blobs, commit


def _read(member: IO[bytes] | None) -> bytes:
    """A regular member's data (tarfile gives every regular member a file object)."""
    assert member is not None
    return member.read()
