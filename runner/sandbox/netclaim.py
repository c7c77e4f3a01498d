"""The network claim: a VM the engine restored for a request gets the request's egress policy.

The engine (`runner.vm.engine`) makes and ends VMs in the namespaces of its slot pool and knows
nothing of policy: a slot denies all traffic from its creation (and again after each release, which
`VM.destroy` does on every way out: a normal end, an error, the TTL, a dead VMM) until this step
renders the request's policy (`policy.render`) and loads it into the slot (`Slot.apply_policy`,
through `runner.net.firewall`). So the guest never runs unfiltered, and never under a policy other
than its request's: the job's code runs only after the claim returns.
"""

from __future__ import annotations

from policy.model import DENY_ALL
from runner.sandbox.port import VMRequest
from runner.vm.errors import SandboxError
from runner.vm.vm import VM


def cut_network(vm: VM) -> None:
    """Load deny-all into `vm`'s slot, in place of whatever its request's policy allowed: the guest reaches
    nothing from now on (a failed job's VM kept for the operator, docs/debugging.md). Raises a SandboxError
    when the rules cannot be loaded: the caller destroys the VM rather than keep it on its old policy."""
    if vm.slot is None:
        return  # no network card: it reaches nothing already
    try:
        vm.slot.apply_policy(DENY_ALL)
    except Exception as exc:
        raise SandboxError(f"could not cut VM {vm.id}'s network to deny-all: {exc}") from None


def claim_network(vm: VM, request: VMRequest) -> None:
    """Load `request`'s policy (deny-all when it has none) into `vm`'s slot; a VM without a network
    card has nothing to claim. Raises a SandboxError when the rules cannot be loaded: the caller
    destroys the VM, since the guest must not run on under an unknown ruleset."""
    if vm.slot is None:
        return
    try:
        vm.slot.apply_policy(request.policy if request.policy is not None else DENY_ALL)
    except Exception as exc:
        raise SandboxError(f"could not start a VM from template {request.template!r}: the egress policy could "
                           f"not be loaded into the VM's network: {exc}") from None
