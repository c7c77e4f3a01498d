"""The VM engine: restores VMs from templates, keeps track of them and makes sure they end.

One engine owns one VM directory (an exclusive lock on it), so at start-up everything found
there belongs to a dead predecessor and is swept. A reaper thread ends VMs whose TTL expired or
whose VMM died on its own; `close()` (also at interpreter exit) ends all of them.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import re
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

from policy.model import DENY_ALL
from runner.vm import checkoutdisk
from runner.vm.agent import AgentClient
from runner.vm.errors import SandboxError, VMError
from runner.vm.hypervisor import Hypervisor, Launch, Snapshot
from runner.vm.pool import SpareVMs
from runner.vm.qemu import QemuHypervisor
from runner.vm.statedir import StateDir
from runner.vm.sweep import sweep
from runner.vm.templates import Template, TemplateNotFound, TemplateStore
from runner.vm.vm import VM

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.5
READY_TIMEOUT_S = 30.0
LOCK_NAME = ".engine.lock"


class Engine:
    """Built by its owner (`runner.service.host.ServiceHost`, a test, a benchmark) and handed to whatever
    needs VMs; there is no process-wide registry. `close()` ends every VM, also at interpreter exit."""

    def __init__(
        self,
        state: StateDir,
        templates: TemplateStore | None = None,
        hypervisor: Hypervisor | None = None,
        pool_size: int = 2,
        net=None,
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
        self.pool = SpareVMs(self._restore, pool_size)
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
        return template

    def create(
        self,
        template: str,
        *,
        network: bool,
        policy=None,
        ttl_seconds: float = 600.0,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        hostname: str | None = None,
    ) -> VM:
        started = time.monotonic()
        tpl = self.template(template)
        _check_resources(tpl, vcpus, memory_mib)
        if network and self.net is None:
            raise SandboxError("this engine has no networking configured; create the sandbox with network=False")
        snapshot = tpl.snapshot(network)
        vm = self.pool.take(snapshot)
        try:
            if vm is None:
                vm = self._restore(snapshot, identity=False)  # _claim gives it its identity
            vm.expires_at = started + ttl_seconds
            with self._vms_lock:
                self._vms[vm.id] = vm
            self._claim(vm, policy, hostname or f"mvc-{vm.id[:8]}")
        except BaseException as exc:
            if vm is not None:
                why = vm.describe_failure() if vm.failure else str(exc)
                self.destroy(vm)
            else:
                why = str(exc)
            if isinstance(exc, SandboxError):
                raise SandboxError(f"could not start a VM from template {template!r}: {why}") from None
            raise
        vm.ready_ms = (time.monotonic() - started) * 1000
        self.pool.refill(snapshot)
        return vm

    def _claim(self, vm: VM, policy, hostname: str) -> None:
        """Make a restored VM this job's: its egress policy, then its own clock, entropy and name."""
        if vm.slot is not None:
            try:
                vm.slot.apply_policy(policy if policy is not None else DENY_ALL)
            except Exception as exc:  # the guest must not run on with an unknown ruleset
                raise SandboxError(f"the egress policy could not be loaded into the VM's network: {exc}") from exc
        vm.agent.identity(hostname=_hostname(hostname), vm_id=vm.id, timeout=READY_TIMEOUT_S)

    def _restore(self, snapshot: Snapshot, identity: bool = True) -> VM:
        """Spawn, restore and resume a VM, and run the agent's paths once.

        Under TCG every clone starts with an empty translation cache, so the first answer from a
        restored guest costs 100-300 ms of translation; doing that here, before any job owns the VM,
        is what lets the warm pool hand out VMs that answer in milliseconds; the checkout's
        paths are rehearsed too (runner/vm/checkoutdisk.py). A networked VM's slot
        denies all traffic from its creation until `_claim` loads the job's policy, so the guest
        never runs unfiltered. `identity=False` skips the placeholder identity for a VM that is
        claimed right away (a pool miss): `_claim` sends the real one.
        """
        vm = self._spawn(snapshot)
        try:
            vm.machine.restore(snapshot)
            vm.agent = AgentClient(vm.machine.agent, on_broken=vm.channel_broken)
            vm.machine.resume()
            if identity:
                vm.agent.identity(hostname="microvm", vm_id=vm.id, timeout=READY_TIMEOUT_S)
            vm.agent.exec({"argv": ["true"], "cwd": "/"}, lambda stream, data: None, timeout=READY_TIMEOUT_S)
            if identity:  # a pooled VM; a pool miss is claimed at once, rehearsing would only add time
                checkoutdisk.rehearse(vm, self._rehearsal_image, READY_TIMEOUT_S)
        except BaseException:
            vm.destroy()
            raise
        return vm

    def _spawn(self, snapshot: Snapshot) -> VM:
        vm_id = uuid.uuid4().hex[:16]
        vm_dir = self.state.vms / vm_id
        vm_dir.mkdir(mode=0o700)
        slot = None
        try:
            overlay = vm_dir / "disk.qcow2"
            _make_overlay(snapshot.disk, overlay)
            namespace = ""
            if snapshot.config.network:
                slot = self.net.acquire()
                namespace = slot.netns  # where the host opens the VM's tap; QEMU itself runs in none
            launch = Launch(vm_dir=vm_dir, disk=overlay, disk_format="qcow2", netns=namespace)
            machine = self.hv.spawn(snapshot, launch)
        except BaseException:
            if slot is not None:
                self._release_slot(slot)
            shutil.rmtree(vm_dir, ignore_errors=True)
            raise
        return VM(id=vm_id, dir=vm_dir, machine=machine, snapshot=snapshot, slot=slot, release_slot=self._release_slot)

    def _release_slot(self, slot) -> None:
        if self.net is not None:
            self.net.release(slot)

    # ---- ending ------------------------------------------------------------------------------
    def destroy(self, vm: VM) -> None:
        try:
            vm.destroy()
        finally:
            self._forget(vm)

    def _forget(self, vm: VM) -> None:
        with self._vms_lock:
            self._vms.pop(vm.id, None)

    def live(self) -> list[VM]:
        with self._vms_lock:
            return list(self._vms.values())

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            for vm in self.live():
                try:
                    self._reap(vm, now)
                except Exception:  # one VM failing to end must not stop the reaper for all others
                    log.exception("could not end VM %s cleanly", vm.id)

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
        self.pool.close()
        for vm in self.live():
            try:
                vm.fail("the engine shut down")  # destroys the VM
            except Exception:
                log.exception("could not end VM %s cleanly", vm.id)
            finally:
                self._forget(vm)
        self._lock_file.close()


def _check_resources(tpl: Template, vcpus: int | None, memory_mib: int | None) -> None:
    """A restore has exactly the template's CPUs and memory; asking for others is an error, not a surprise."""
    m = tpl.manifest
    if vcpus is not None and vcpus != m["vcpus"]:
        raise SandboxError(f"template {tpl.name!r} has {m['vcpus']} vCPU(s), not {vcpus}: bake a template with a recipe that asks for {vcpus}")
    if memory_mib is not None and memory_mib != m["memory_mib"]:
        raise SandboxError(f"template {tpl.name!r} has {m['memory_mib']} MiB of memory, not {memory_mib}: bake a template with a recipe that asks for {memory_mib}")


def _make_overlay(base: Path, overlay: Path) -> None:
    proc = subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw", str(overlay)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise VMError(f"qemu-img could not create the VM's disk overlay: {proc.stderr.strip()}")


def _hostname(text: str) -> str:
    """A valid hostname from a job name: the guest gets it, so it is sanitised here."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63]
    return name or "microvm"
