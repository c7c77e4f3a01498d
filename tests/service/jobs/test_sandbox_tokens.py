"""A sandbox's token opens that sandbox and no other, forks included (runner/service/jobs/sandboxes.py `find`).

A fork is restored from its parent's snapshot by the same owner: the kin a lookup by lineage could
confuse. The real VM test (test_vm_sdk.py's tour) tries the parent's and the fork's tokens on each
other; here every pair of a parent, two forks of it (siblings) and an unrelated sandbox of the same
owner is tried, on the stand-in engine (a snapshot of it is only a name)."""

from __future__ import annotations

from collections.abc import Callable

from runner.sandbox.fake import FakeSandboxes
from runner.service.host.assembly import ServiceHost
from runner.service.jobs.sandboxes import Owner, SandboxDesk, SandboxRefused, SandboxRequest


def test_each_of_a_parents_a_forks_and_a_siblings_token_opens_only_its_own_sandbox(
        hosts: Callable[..., ServiceHost], engine: FakeSandboxes) -> None:
    host = hosts(serve_api=False, sandboxes={"max_live": 4, "max_per_caller": 4})
    assert host.service is not None
    desk = SandboxDesk(host.config, engine.create, host.service.policies, host.service.records.put,
                       forget_template=lambda name: None)
    owner = Owner("uid 4242")
    try:
        parent, parent_token = desk.create(owner, SandboxRequest.parse({}, host.config))
        base = desk.snapshot(parent)
        fork, fork_token = desk.create(owner, SandboxRequest.parse({"base": base}, host.config))
        sibling, sibling_token = desk.create(owner, SandboxRequest.parse({"base": base}, host.config))
        other, other_token = desk.create(owner, SandboxRequest.parse({}, host.config))
        sandboxes = {"parent": parent, "fork": fork, "sibling": sibling, "other": other}
        tokens = {"parent": parent_token, "fork": fork_token, "sibling": sibling_token, "other": other_token}

        def opens(name: str, token: str) -> bool:
            try:
                return desk.find(sandboxes[name].id, token) is sandboxes[name]
            except SandboxRefused:
                return False

        opened = {(sandbox, holder) for sandbox in sandboxes for holder, token in tokens.items() if opens(sandbox, token)}
        assert opened == {(name, name) for name in sandboxes}, "a token opened a sandbox not its own"
    finally:
        desk.close()
