"""The network claim (runner.sandbox.netclaim) with fakes, no QEMU: the sandbox layer, not the engine,
loads a VM request's egress policy, deny-all when it has none, and a VM whose rules cannot be loaded
never reaches its job."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from policy import DENY_ALL, load_policy
from policy.model import Policy
from runner.sandbox.netclaim import claim_network
from runner.sandbox.port import VMRequest
from runner.sandbox.sandbox import Sandbox
from runner.vm.errors import SandboxError

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FakeSlot:
    fails: bool = False
    applied: list[Policy] = field(default_factory=list)

    def apply_policy(self, policy: Policy) -> None:
        if self.fails:
            raise OSError("iptables-restore: line 3 failed")
        self.applied.append(policy)


@dataclass
class FakeVM:
    slot: FakeSlot | None
    ready_ms: float = 1.0


@dataclass
class FakeEngine:
    vm: FakeVM
    requests: list[VMRequest] = field(default_factory=list)
    destroyed: list[FakeVM] = field(default_factory=list)

    def create(self, request: VMRequest) -> FakeVM:
        self.requests.append(request)
        return self.vm

    def destroy(self, vm: FakeVM) -> None:
        self.destroyed.append(vm)


def test_a_request_without_a_policy_claims_deny_all() -> None:
    slot = FakeSlot()
    claim_network(FakeVM(slot), VMRequest(network_card=True))  # type: ignore[arg-type]
    assert slot.applied == [DENY_ALL]


def test_the_requests_policy_is_loaded_and_a_vm_without_a_card_has_nothing_to_claim() -> None:
    policy = load_policy("version: 1\nallow:\n  - host: pypi.org\n    ports: [443]\n")
    slot = FakeSlot()
    claim_network(FakeVM(slot), VMRequest(policy=policy))  # type: ignore[arg-type]
    assert slot.applied == [policy]
    claim_network(FakeVM(None), VMRequest(policy=policy))  # type: ignore[arg-type]


def test_a_vm_whose_rules_cannot_be_loaded_is_destroyed_before_its_job_gets_it() -> None:
    engine = FakeEngine(FakeVM(FakeSlot(fails=True)))
    request = VMRequest(template="base", network_card=True)
    with pytest.raises(SandboxError, match="could not start a VM from template 'base': the egress policy could not be "
                                           "loaded into the VM's network: iptables-restore: line 3 failed"):
        Sandbox.open(request, engine)  # type: ignore[arg-type]
    assert engine.requests == [request]  # the engine gets the request as it is
    assert engine.destroyed == [engine.vm]


def test_the_engine_knows_nothing_of_policy() -> None:
    tree = ast.parse((ROOT / "runner/vm/engine.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {name for name in imported if name and name.split(".")[0] == "policy"}
    assert "apply_policy" not in (ROOT / "runner/vm/engine.py").read_text()
