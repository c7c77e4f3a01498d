"""Errors of the VM engine. Callers catch `SandboxError` (the sandbox area's base in `runner.errors`,
re-exported here); the subclasses say which side failed."""

from __future__ import annotations

from runner.errors import SandboxError

__all__ = ["SandboxError", "VMError", "AgentError"]


class VMError(SandboxError):
    """The hypervisor could not do what was asked; the message says what and what to do."""


class AgentError(SandboxError):
    """The guest agent broke the protocol, went silent or hung up: the guest is not trusted again."""
