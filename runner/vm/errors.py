"""Errors of the VM engine. Callers catch `SandboxError`; the subclasses say which side failed."""


class SandboxError(RuntimeError):
    """The sandbox cannot go on (its VM died, expired, or its guest misbehaved); it has been destroyed."""


class VMError(SandboxError):
    """The hypervisor could not do what was asked; the message says what and what to do."""


class AgentError(SandboxError):
    """The guest agent broke the protocol, went silent or hung up: the guest is not trusted again."""
