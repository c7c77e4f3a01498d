"""The VM port: what the service asks of the VM layer, and what it gets back, as named types.

The service (and a test's stand-in) speaks only these: a `VMRequest` says which VM a job needs (its
template as a `TemplateChoice` names it), a `SandboxFactory` turns one into a `SandboxLike`, and a
`SandboxProvider` (the engine seen through `runner.sandbox.EngineSandboxes`) also answers what
templates there are and keeps its spare VMs in step with them; runner/sandbox/fake.py is the one fake
of all three, for tests and benchmarks. This module imports nothing that needs root or QEMU, so the
service can name the types without loading the VM layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Protocol

from policy.model import Policy
from policy.suggest import AuditRecord

if TYPE_CHECKING:
    from runner.net.secretswap import SecretSwap
    from runner.sandbox.terminal import Terminal
    from runner.vm.templates import Template

__all__ = ["AuditRecord", "ExecResult", "GuestFiles", "Resources", "SandboxFactory", "SandboxLike", "SandboxProvider",
           "TemplateChoice", "VMRequest", "needs_network"]


def needs_network(policy: Policy | None) -> bool:
    """Whether a VM under `policy` gets a network card: only when the policy allows something (or
    audits, which needs the traffic to record it). A VM whose policy allows nothing gets no card at
    all: nothing to filter, nothing to get wrong. The one place this is decided."""
    return policy is not None and (bool(policy.rules) or policy.mode == "audit")


@dataclass(frozen=True)
class ExecResult:
    """What a command in the VM ended with: the port's own type, so the service and its stand-ins name it
    without the VM layer."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_ms: float
    timed_out: bool
    truncated: bool = False  # output beyond runner.sandbox.sandbox.CAPTURE_LIMIT was streamed but not kept


@dataclass(frozen=True)
class Resources:
    """A VM's size. None: the template's own (a restore has exactly the template's CPUs and memory,
    so asking for another size is an error the engine names, not a surprise)."""

    vcpus: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class TemplateChoice:
    """Which template a VM restores from, and why: what a `VMRequest`'s template and size come from.
    The service decides it in one place (runner/service/jobs/templatechoice.py `choose_template`) for a
    job, a VM pre-warmed for one, a kept VM's first step and a sandbox; a job records its own and its log
    says why."""

    template: str  # the template the VM restores from
    warm_base: bool  # a repository's warm base (runner/service/jobs/bases.py), not the template named
    size: str | None  # the size class the template was baked at (`<template>.<size>`); None: its own size
    why: str  # what it restores from and why, for the job's log ("the repository's warm base ...")


@dataclass(frozen=True)
class VMRequest:
    """One VM to restore: which template, for how long at most, how big, under which egress policy,
    and for which job (its hostname in the guest).

    Whether it has a network card follows from the policy (`needs_network`); `network_card` overrides
    that only where the VM's variant is what matters, not its traffic: a warm base of the `net` variant
    is set up under whatever its section allows, deny-all included, and must have a card to be
    restorable with one (runner/service/jobs/bases.py)."""

    template: str = "base"
    ttl_seconds: float = 600.0
    resources: Resources = field(default_factory=Resources)
    policy: Policy | None = None
    job_id: str | None = None
    network_card: bool | None = None

    @property
    def network(self) -> bool:
        return needs_network(self.policy) if self.network_card is None else self.network_card


class GuestFiles(Protocol):
    """Single files in the guest (`runner.sandbox.sandbox.Files`)."""

    def write(self, path: str, data: bytes | BinaryIO, mode: int = 0o644) -> None: ...  # bytes, or a file read to its end
    def read(self, path: str, max_bytes: int = ...) -> bytes: ...


class SandboxLike(Protocol):
    """What the service needs of a sandbox: `runner.sandbox.Sandbox`, or a test's stand-in."""

    @property
    def id(self) -> str: ...
    @property
    def ready_ms(self) -> float: ...
    @property
    def accel(self) -> str: ...  # the accelerator its VM runs on ("kvm" | "tcg")
    @property
    def alive(self) -> bool: ...  # False once destroyed (by anyone: its TTL, a dead VMM, a cancel)
    @property
    def template_manifest(self) -> dict[str, object] | None: ...  # None: its build went away
    @property
    def files(self) -> GuestFiles: ...

    def put_tar(self, stream: BinaryIO, dest: str = "/workspace") -> None: ...
    def exec(self, command: str | list[str], timeout_seconds: float | None = None, env: dict[str, str] | None = None,
             cwd: str = "/workspace", user: str | None = None, on_output: Callable[[str, bytes], None] | None = None,
             capture_bytes: int = ..., stdin: bytes | None = None) -> ExecResult: ...
    def get_tar(self, paths: list[str], out: BinaryIO, max_bytes: int, cwd: str = "/") -> int: ...
    def terminal(self, argv: list[str], cwd: str = "/workspace", env: dict[str, str] | None = None,
                 size: tuple[int, int] = (24, 80), timeout_seconds: float = 3600.0,
                 user: str | None = None) -> Terminal: ...  # a pty session in its VM (runner.sandbox.terminal)
    def blocked_egress(self) -> Sequence[AuditRecord]: ...  # what its policy refused (audit: would refuse)
    def install_job_ca(self) -> dict[str, str]: ...  # the job CA's variables for its commands ({}: none)
    def bind_secrets(self, swap: SecretSwap) -> dict[str, str]: ...  # the placeholders' variables (before the CA)
    def secret_uses(self) -> dict[str, int]: ...  # requests each binding's value went into, by name
    def cut_network(self) -> None: ...  # its network denies everything from now on (a VM kept for debugging)
    def snapshot(self, name: str, *, digest: str | None = None, extra: dict[str, object] | None = None) -> str: ...
    def destroy(self) -> None: ...


SandboxFactory = Callable[[VMRequest], SandboxLike]
"""Restores the VM a request asks for (`SandboxProvider.create`, or a test's stand-in)."""


class SandboxProvider(Protocol):
    """What warm bases and the host need beyond `create`: the templates and the spare VMs restored
    ahead from them (runner/vm/pool.py). Implemented by `runner.sandbox.EngineSandboxes`."""

    @property
    def networked(self) -> bool: ...  # it can make VMs with a network card (the host gave it slots)

    def create(self, request: VMRequest) -> SandboxLike: ...

    def template(self, name: str) -> Template:
        """The current template `name`, restorable here (else a SandboxError that says how to fix it)."""
        ...

    def find_template(self, name: str) -> Template | None:
        """The current template `name` as the store holds it, or None."""
        ...

    def forget(self, name: str) -> None:
        """End the spare VMs restored from template `name` (before it goes: none may outlive its files)."""
        ...

    def remove(self, name: str) -> None:
        """Remove template `name` (a snapshot nobody restores from any more), its spare VMs first."""
        ...

    def sandbox_snapshots(self) -> list[str]:
        """The sandboxes' snapshots a service that ended left (removed at start-up); not those of another
        engine, on a state directory of its own, that shares the template store and may be using them."""
        ...

    def refill(self, template: Template, network: bool) -> None:
        """Restore spare VMs of one variant of `template` ahead of demand (a base rebuilt in place)."""
        ...

    def evict(self, budget_bytes: int, keep: frozenset[str] = frozenset()) -> list[str]:
        """Remove derived templates (not sandboxes' snapshots), least recently used first, until they fit
        `budget_bytes`; each one's spare VMs end first. The names removed."""
        ...
