"""The VM engine: restores VMs from templates, keeps track of them and makes sure they end.

One engine owns one VM directory (an exclusive lock on it), so at start-up everything found
there belongs to a dead predecessor and is swept. A reaper thread ends VMs whose TTL expired or
whose VMM died on its own; `close()` (also at interpreter exit) ends all of them.

A networked VM runs in a namespace the engine is given (a slot of its `SlotPool`), which denies all
traffic until the VM's owner loads a policy into it: the engine knows nothing of egress policy
(the sandbox layer's network claim, `runner.sandbox.netclaim`, loads it).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from runner.errors import TemplateError
from runner.net.slots import SlotPool
from runner.vm import cgroup, checkoutdisk
from runner.vm.agent import PROTOCOL_ERROR_KINDS, AgentClient, AgentTooOld, QuiesceFailed
from runner.vm.errors import SandboxError, VMError
from runner.vm.hypervisor import Hypervisor, Launch, Snapshot
from runner.vm.pool import SpareVMs
from runner.vm.qemu import QemuHypervisor
from runner.vm.statedir import StateDir
from runner.vm.sweep import sweep
from runner.vm.templates import CURRENT, NAME, DigestHold, Template, TemplateNotFound, TemplateStore, stale_agent
from runner.vm.vm import VM

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.5
READY_TIMEOUT_S = 30.0
LOCK_NAME = ".engine.lock"
QUIESCE_S = 3.0  # docs/platform.md: a guest snapshotted while still busy gives clones that answer slowly
QUIESCE_TIMEOUT_S = 120.0


class ResourcesLike(Protocol):
    """A VM's size as the engine reads it (`runner.sandbox.Resources`); None: the template's own."""

    @property
    def vcpus(self) -> int | None: ...
    @property
    def memory_mib(self) -> int | None: ...


class VMRequestLike(Protocol):
    """What the engine reads of a `runner.sandbox.VMRequest`, declared here because the VM layer sits
    below the port that defines it: which template, with a network card or not, for how long, how big,
    and for which job (the guest's hostname). Its policy is not the engine's to read."""

    @property
    def template(self) -> str: ...
    @property
    def network(self) -> bool: ...
    @property
    def ttl_seconds(self) -> float: ...
    @property
    def resources(self) -> ResourcesLike: ...
    @property
    def job_id(self) -> str | None: ...


class Engine:
    """Built by its owner (`runner.service.host.assembly.ServiceHost`, a test, a benchmark) and handed to whatever
    needs VMs; there is no process-wide registry. `close()` ends every VM, also at interpreter exit."""

    def __init__(
        self,
        state: StateDir,
        templates: TemplateStore | None = None,
        hypervisor: Hypervisor | None = None,
        pool_size: int = 2,
        net: SlotPool | None = None,
    ) -> None:
        self.state = state.ensure()
        self.templates = templates or TemplateStore(state.templates)
        self.hv = hypervisor or QemuHypervisor()
        self.net = net  # a started runner.net.SlotPool, or None: then VMs cannot have a network
        self._rehearsal_image = checkoutdisk.rehearsal_image(self.state.cache)
        self._lock_file = open(self.state.vms / LOCK_NAME, "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise VMError(
                f"another microvm-check engine is using {self.state.vms}: stop it, or give this one its own "
                "state directory (MICROVM_CHECK_STATE)"
            ) from None
        swept = sweep(self.state.vms, keep=frozenset({LOCK_NAME}))
        if swept:
            log.warning("swept leftovers of a previous run: %s", ", ".join(swept))
        self._vms: dict[str, VM] = {}
        self._vms_lock = threading.Lock()
        self._protocol_errors = dict.fromkeys(PROTOCOL_ERROR_KINDS, 0)  # under _vms_lock
        self._preparing: dict[Snapshot, VM] = {}  # the spare each pool filler is preparing now (under _vms_lock)
        self._digests = DigestUsers(self.templates)
        self.pool = SpareVMs(self._restore, pool_size, cap=_memory_cap, hurry=self._hurry, cancel=self._cancel)
        # VMMs spawned ahead (jail, cgroup, descriptors, QEMU's own start-up), waiting at `-incoming defer`:
        # a restore that finds one skips 50-60 ms of spawning. Refilled after a restore, not during one: a
        # QEMU starting on the same two cores made the restore slower than spawning its own (measured).
        # 25-35 MiB of PSS each; only where a pool is wanted at all. Exactly one per snapshot, replaced one
        # for one: no cap, so not sized from demand (under load that asked for 2-3 of them and kept them).
        self._standby = SpareVMs(self._spawn_now, 1 if pool_size > 0 else 0)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="vm-reaper", daemon=True)
        self._reaper.start()
        self._closed = False
        atexit.register(self.close)  # an owner that dies without closing must not leave VMs running

    # ---- creating ----------------------------------------------------------------------------
    def template(self, name: str) -> Template:
        try:
            template = self.templates.get(name)
        except TemplateNotFound as exc:
            raise SandboxError(str(exc)) from None
        if template.manifest.get("hypervisor_version") != self.hv.version():
            raise SandboxError(
                f"template {name!r} was baked by {template.manifest.get('hypervisor_version')!r} but this host runs "
                f"{self.hv.version()!r}: rebuild it with 'microvm-check template build {name}'"
            )
        stale = stale_agent(template)
        if stale is not None:
            raise SandboxError(stale)
        return template

    def create(self, request: VMRequestLike) -> VM:
        """A running VM for `request`: a spare if one is ready, else restored now; given its identity.
        A networked one is in a slot that still denies everything: its owner loads the policy."""
        started = time.monotonic()
        template = request.template
        tpl = self.template(template)
        _check_resources(tpl, request.resources)
        self.templates.touch(template)
        if request.network and self.net is None:
            raise SandboxError("this engine has no networking configured; create the sandbox with network=False")
        try:
            snapshot = tpl.snapshot(request.network)
        except TemplateNotFound as exc:
            raise SandboxError(str(exc)) from None
        vm = self.pool.take(snapshot)
        try:
            if vm is None:
                missed_at = time.monotonic()
                vm = self._restore(snapshot, identity=False, respawn=False)  # _identify gives it its identity
                self.pool.missed(snapshot, time.monotonic() - missed_at)
            else:
                vm.machine.set_spare(False)
            vm.expires_at = started + request.ttl_seconds
            with self._vms_lock:
                self._vms[vm.id] = vm
            self._identify(vm, request.job_id or f"mvc-{vm.id[:8]}")
        except BaseException as exc:
            if vm is not None:
                why = vm.describe_failure() if vm.failure else str(exc)
                self.destroy(vm)
            else:
                why = str(exc)
            self._standby.refill(snapshot)
            if isinstance(exc, SandboxError):
                raise SandboxError(f"could not start a VM from template {template!r}: {why}") from None
            raise
        vm.ready_ms = (time.monotonic() - started) * 1000
        if tpl.manifest.get("pooled", True) is False:  # restored once (a hibernated sandbox's): no VM ahead of it
            return vm
        # After the identity, not during it: a restore started on the same cores slows it (measured).
        # Ahead of demand is the pool's target, which counts the arrivals expected during one refill.
        self.pool.refill(snapshot)
        self._standby.refill(snapshot)  # after a miss: the successor of the VMM its restore took
        return vm

    # ---- snapshotting ------------------------------------------------------------------------
    def snapshot(self, vm: VM, name: str, digest: str | None = None, extra: dict[str, object] | None = None,
                 quiet_s: float = QUIESCE_S) -> Template:
        """Make template `name` out of a running VM (RAM and disk as they are now) and return it.

        The guest is quiesced first (its checkout unmounted and ejected, its page cache written and
        dropped, then left quiet for `quiet_s`), so a VM in the middle of writing is still taken
        safely. The VM is paused only while its memory and disk are copied, and runs on after,
        without its checkout. The new template has the VM's one variant (with or without a network
        card); `digest` keys it (a new one per call by default), `extra` goes into its manifest.
        """
        if not NAME.fullmatch(name):
            raise SandboxError(f"{name[:80]!r} is not a template name: use lower-case letters, digits, '.', '_' and "
                               "'-' (at most 200), starting with a letter or digit")
        if vm.destroyed or vm.agent is None:
            raise SandboxError(f"cannot snapshot VM {vm.id}: {vm.describe_failure()}")
        parent = self.templates.owner(vm.snapshot)
        variant = "net" if vm.snapshot.config.network else "nonet"
        digest = digest or uuid.uuid4().hex[:20]
        try:
            path = self.templates.begin(name, digest)
        except TemplateError as exc:
            raise SandboxError(f"could not snapshot VM {vm.id} as template {name!r}: {exc}") from None
        work = self.state.vms / f"{vm.id}-fold-{uuid.uuid4().hex[:6]}"
        try:
            self._quiesce(vm, quiet_s)
            target = Template.variant_files(vm.snapshot, path / variant)
            target.state_file.parent.mkdir()
            stream = path / "machine.stream"
            try:
                vm.machine.save(stream)
                vm.machine.export_disk(vm.snapshot.disk, target.disk)
            finally:
                if vm.machine.alive():
                    vm.machine.resume()
            target.disk.chmod(0o444)  # the fold's QEMU, as the VM user, reads it
            work.mkdir(mode=0o700)
            self.hv.fold(stream, target, work)
            stream.unlink()
            self.templates.write_derived(path, parent, variant, {**(extra or {}), "made_in": str(self.state.root.resolve())})
            for entry in (target.mem_file, target.state_file):
                entry.chmod(0o444)  # every clone maps these; nothing may ever write them again
            self.templates.publish(name, digest)
        except BaseException as exc:
            self.templates.abandon(name, digest)
            if isinstance(exc, (VMError, OSError)):
                raise SandboxError(f"could not snapshot VM {vm.id} as template {name!r}: {exc}") from None
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return self.templates.get(name)

    def _quiesce(self, vm: VM, quiet_s: float) -> None:
        assert vm.agent is not None, "snapshot() refuses a VM without an agent channel"
        try:
            done = vm.agent.quiesce(QUIESCE_TIMEOUT_S)
        except AgentTooOld as exc:
            # Either a template whose manifest claims an agent it does not have (copied by hand, say), or
            # a guest that ran a job's code and answers as it likes: the host cannot tell which, so the
            # message names both rather than send the operator to rebuild a sound template.
            template = self.templates.owner(vm.snapshot)
            raise SandboxError(f"could not quiesce VM {vm.id} for its snapshot: its guest answered that it does "
                               f"not know {exc.op!r}. Either the code this VM ran (untrusted) made it answer so, "
                               f"or {stale_agent(template, frozenset({exc.op}))}") from None
        except QuiesceFailed as exc:
            raise SandboxError(f"could not quiesce VM {vm.id} for its snapshot: {exc}") from None
        log.debug("VM %s quiesced: %d checkout mounts unmounted, page cache written in %.0f ms", vm.id,
                  done.unmounted, done.sync_ms)
        if vm.checkout_drive_used:
            vm.machine.eject_medium()
            vm.checkout_drive_used = False
        time.sleep(quiet_s)

    def forget_template(self, name: str) -> None:
        """End the spare VMs of `name`, those being prepared included, and prepare none again (before it is
        removed: none may outlive its files, and no one would ever take them). The spare pool first: its
        filler's restore starts a VMM ahead, which the standby pool's forget then ends."""
        try:
            template = self.templates.get(name)
        except (TemplateNotFound, OSError, ValueError):
            return
        for variant in template.variants:
            snapshot = template.snapshot(variant == "net")
            for vm in (*self.pool.forget(snapshot), *self._standby.forget(snapshot)):
                vm.destroy()
            self.hv.forget(snapshot)
        self._digests.release(everything=False)  # the template's removal, next, finds its files let go

    def is_leftover(self, template: Template) -> bool:
        """Whether `template`, a sandbox's snapshot, is left over from a service that ended (no sandbox outlives
        its service, so it goes at start-up): made on this state directory (by a predecessor: one engine per
        directory), on one that is gone, or before makers were recorded. Another engine's, on a state
        directory of its own that shares this template store (`localrun` beside `serve`, tests), may be in use."""
        made_in = template.made_in
        return made_in is None or made_in == self.state.root.resolve() or not made_in.exists()

    def _identify(self, vm: VM, hostname: str) -> None:
        """Make a restored VM this job's: its own clock, entropy and name."""
        assert vm.agent is not None, "_restore gives every VM its agent before a job can take it"
        vm.agent.identity(hostname=_hostname(hostname), vm_id=vm.id, timeout=READY_TIMEOUT_S)

    def _restore(self, snapshot: Snapshot, identity: bool = True, respawn: bool = True) -> VM:
        """Spawn, restore and resume a VM, and run the agent's paths once.

        Under TCG every clone starts with an empty translation cache, so the first answer from a
        restored guest costs 100-300 ms of translation; doing that here, before any job owns the VM,
        is what lets the warm pool hand out VMs that answer in milliseconds; the checkout's
        paths are rehearsed too (runner/vm/checkoutdisk.py). A networked VM's slot
        denies all traffic from its creation until the VM's owner loads a policy into it, so the
        guest never runs unfiltered. `identity=False` skips the placeholder identity for a VM that is
        taken right away (a pool miss): `_identify` sends the real one. `respawn=False` leaves spawning
        the next VMM ahead to the caller (a miss: after its identity, which a QEMU starting beside it slowed).
        """
        vm = self._spawn(snapshot)
        try:
            if identity:  # a spare: it takes only the CPU the jobs' VMs leave, unless a take waits for it
                with self._vms_lock:
                    self._preparing[snapshot] = vm
            else:  # a pool miss: a job is waiting for this VM
                vm.machine.set_spare(False)
            vm.machine.restore(snapshot)
            vm.agent = AgentClient(vm.machine.agent, on_broken=vm.channel_broken,
                                   on_protocol_error=self._protocol_error)
            vm.machine.resume()
            if identity:
                vm.agent.identity(hostname="microvm", vm_id=vm.id, timeout=READY_TIMEOUT_S)
            vm.agent.exec({"argv": ["true"], "cwd": "/"}, lambda stream, data: None, timeout=READY_TIMEOUT_S)
            if identity:  # a pooled VM; a pool miss is taken at once, rehearsing would only add time
                checkoutdisk.rehearse(vm, self._rehearsal_image, READY_TIMEOUT_S)
        except BaseException:
            vm.destroy()
            self._standby.refill(snapshot)
            raise
        finally:
            if identity:
                with self._vms_lock:
                    self._preparing.pop(snapshot, None)
        if respawn:
            self._standby.refill(snapshot)  # the next restore's VMM, spawned now that this one is done
        return vm

    def _hurry(self, snapshot: Snapshot) -> None:
        """A take waits for the spare being prepared for `snapshot`: it gets a job's CPU share now."""
        with self._vms_lock:
            vm = self._preparing.get(snapshot)
        if vm is not None:
            try:
                vm.machine.set_spare(False)
            except VMError as exc:  # it only goes slower; the take's wait is bounded
                log.warning("%s", exc)

    def _cancel(self, snapshot: Snapshot) -> None:
        """The spare being prepared for `snapshot` will never be taken (its template is going): end it now,
        so its restore fails at once rather than run to the end for nothing."""
        with self._vms_lock:
            vm = self._preparing.get(snapshot)
        if vm is not None:
            vm.destroy()

    def _spawn(self, snapshot: Snapshot) -> VM:
        """A VMM for `snapshot`, not yet restored: one spawned ahead if there is one, else a new one."""
        vm = self._standby.take(snapshot)
        return vm if vm is not None else self._spawn_now(snapshot)

    def _spawn_now(self, snapshot: Snapshot) -> VM:
        vm_id = uuid.uuid4().hex[:16]
        self._digests.take(snapshot)  # before its files are opened: no other process removes them from now on
        vm_dir = self.state.vms / vm_id
        slot = None
        try:
            vm_dir.mkdir(mode=0o700)
            disk = self.hv.overlay(snapshot.disk, vm_dir)
            namespace = ""
            if snapshot.config.network:
                assert self.net is not None, "create() refuses a networked template without self.net"
                slot = self.net.acquire()
                namespace = slot.netns  # where the host opens the VM's tap; QEMU itself runs in none
            launch = Launch(vm_dir=vm_dir, disk=disk.path, disk_format=disk.format, netns=namespace)
            machine = self.hv.spawn(snapshot, launch)
        except BaseException:
            self._digests.drop(snapshot)
            if slot is not None and self.net is not None:
                self.net.release(slot)
            shutil.rmtree(vm_dir, ignore_errors=True)
            raise
        vm = VM(id=vm_id, dir=vm_dir, machine=machine, snapshot=snapshot, slot=slot, slots=self.net)
        self._digests.attach(vm)
        return vm

    # ---- ending ------------------------------------------------------------------------------
    def destroy(self, vm: VM) -> None:
        try:
            vm.destroy()
        finally:
            self._forget(vm)
            self._digests.release(everything=False)  # now, not at the reaper's next round: a removal may follow

    def _forget(self, vm: VM) -> None:
        with self._vms_lock:
            self._vms.pop(vm.id, None)

    def standby_vmms(self) -> int:
        """VMMs spawned ahead and waiting for a restore (QEMU processes with no guest yet), all variants."""
        return sum(self._standby.ready().values())

    def live(self) -> list[VM]:
        with self._vms_lock:
            return list(self._vms.values())

    @property
    def protocol_errors(self) -> dict[str, int]:
        """VMs destroyed because their guest broke the agent protocol, by kind (agent.PROTOCOL_ERROR_KINDS),
        since this engine started; a copy, read by the service's metrics at scrape time."""
        with self._vms_lock:
            return dict(self._protocol_errors)

    def _protocol_error(self, kind: str) -> None:
        """A VM's agent channel broke on a protocol error (its `on_broken` destroys the VM next)."""
        with self._vms_lock:
            self._protocol_errors[kind] = self._protocol_errors.get(kind, 0) + 1

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            for vm in self.live():
                try:
                    self._reap(vm, now)
                except Exception:  # one VM failing to end must not stop the reaper for all others
                    log.exception("could not end VM %s cleanly", vm.id)
            self._end_superseded_spares()
            self._digests.release(everything=False)

    def _end_superseded_spares(self) -> None:
        """Spare VMs of a digest that is no longer its template's current one (another process published a
        newer build, or removed the template) are never taken: end them, so that the digest is let go and its
        files can go. VMs that jobs hold run on."""
        for snapshot in self._digests.superseded():
            for vm in (*self.pool.forget(snapshot), *self._standby.forget(snapshot)):
                vm.destroy()

    def _reap(self, vm: VM, now: float) -> None:
        if vm.destroyed:
            self._forget(vm)
            return
        if now >= vm.expires_at:
            why = "the sandbox expired after its TTL"
        elif not vm.machine.alive():
            why = f"the VM's hypervisor process exited (status {vm.machine.exit_status()})"
        else:
            return
        try:
            vm.fail(why)  # destroys the VM
        finally:
            self._forget(vm)

    def close(self) -> None:
        """End every VM and release the VM directory; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        self._reaper.join()  # it may be ending a VM right now; after this only this thread touches them
        self.pool.close()  # before the standby VMMs: its fillers may be taking one
        self._standby.close()
        for vm in self.live():
            try:
                vm.fail("the engine shut down")  # destroys the VM
            except Exception:
                log.exception("could not end VM %s cleanly", vm.id)
            finally:
                self._forget(vm)
        cgroup.remove_scope(cgroup.scope_for(self.state.vms))  # its VMs' cgroups went with them
        self._digests.release(everything=True)
        self._lock_file.close()


@dataclass
class _Use:
    """One digest this engine holds: its VMs (spare, standby or a job's) and the spawns under way."""

    hold: DigestHold
    vms: list[VM] = field(default_factory=list)
    starting: int = 0


class DigestUsers:
    """The template digests this engine's VMs run from, each held (`TemplateStore.hold`) from before its
    first VM is spawned until its last one has ended: another process sharing the store (a publish of a
    newer build, a removal, an eviction) then leaves its files alone, which a VM of it reads for as long as
    it runs (a spare's restore, a snapshot's lineage). Once let go, a digest no longer current is removed
    (`TemplateStore.collect`). The reaper lets go of unused ones; `close` of all of them."""

    def __init__(self, store: TemplateStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._uses: dict[Path, _Use] = {}

    def take(self, snapshot: Snapshot) -> None:
        """A VM of `snapshot` is about to be spawned: hold its digest (then `attach` the VM, or `drop`)."""
        path = _digest_dir(snapshot)
        with self._lock:
            use = self._uses.get(path)
            if use is None:
                try:
                    use = self._uses[path] = _Use(self._store.hold(path))
                except TemplateNotFound:
                    raise SandboxError(f"template {path.parent.name!r} was replaced or removed by another process "
                                       "as this VM started: try again") from None
            use.starting += 1

    def attach(self, vm: VM) -> None:
        with self._lock:
            use = self._uses[_digest_dir(vm.snapshot)]
            use.starting -= 1
            use.vms.append(vm)

    def drop(self, snapshot: Snapshot) -> None:
        with self._lock:
            self._uses[_digest_dir(snapshot)].starting -= 1

    def superseded(self) -> set[Snapshot]:
        """The snapshots of this engine's VMs whose digest is no longer the current one of its template."""
        with self._lock:
            held = {path: {vm.snapshot for vm in use.vms} for path, use in self._uses.items()}
        return {snapshot for path, snapshots in held.items() if not _is_current(path) for snapshot in snapshots}

    def release(self, everything: bool) -> None:
        """Let go of the digests no VM of this engine runs from any more (all of them: `everything`, at
        close), and remove those no longer current that no one else holds."""
        with self._lock:
            for use in self._uses.values():
                use.vms = [vm for vm in use.vms if not vm.destroyed]
            unused = [path for path, use in self._uses.items() if everything or not (use.vms or use.starting)]
            let_go = [self._uses.pop(path) for path in unused]
        for use in let_go:
            use.hold.close()
            try:
                self._store.collect(use.hold.path.parent.name)
            except OSError as exc:  # it stays on disk until the next publish or collect of the name
                log.warning("could not remove the unused template %s: %s", use.hold.path, exc)


def _is_current(path: Path) -> bool:
    """Whether the digest directory `path` is its template's current build."""
    try:
        return (path.parent / CURRENT).read_text().strip() == path.name
    except FileNotFoundError:
        return False


def _digest_dir(snapshot: Snapshot) -> Path:
    """<templates>/<name>/<digest> of a snapshot's files (<digest>/<variant>/state.bin)."""
    return snapshot.state_file.parent.parent


MEMORY_SHARE_FOR_SPARES = 0.5  # of MemAvailable, for spare VMs beyond the configured pool size


def _memory_cap(snapshot: Snapshot) -> int:
    """How many spare VMs of `snapshot` the host's memory allows right now: half of what is available,
    counted at the guest's full memory size (a VM's worst case; an idle clone's PSS is far less)."""
    try:
        with open("/proc/meminfo") as f:
            available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0  # unknown: the configured size only
    return int(available_kib * MEMORY_SHARE_FOR_SPARES) // (snapshot.config.memory_mib * 1024)


def _check_resources(tpl: Template, resources: ResourcesLike) -> None:
    """A restore has exactly the template's CPUs and memory; asking for others is an error, not a surprise."""
    m, vcpus, memory_mib = tpl.manifest, resources.vcpus, resources.memory_mib
    if vcpus is not None and vcpus != m["vcpus"]:
        raise SandboxError(f"template {tpl.name!r} has {m['vcpus']} vCPU(s), not {vcpus}: "
                           f"bake a template with a recipe that asks for {vcpus}")
    if memory_mib is not None and memory_mib != m["memory_mib"]:
        raise SandboxError(f"template {tpl.name!r} has {m['memory_mib']} MiB of memory, not {memory_mib}: "
                           f"bake a template with a recipe that asks for {memory_mib}")


def _hostname(text: str) -> str:
    """A valid hostname from a job name: the guest gets it, so it is sanitised here."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63]
    return name or "microvm"
