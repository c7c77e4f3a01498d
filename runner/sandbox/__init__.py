"""The Sandbox API: a fresh microVM per use, in the shape users of sandbox SDKs know.

    with Sandbox.create(template="base", ttl_seconds=600, engine=engine) as sbx:
        r = sbx.exec("pytest -q", timeout_seconds=300, cwd="/workspace", on_output=print_chunk)
        sbx.snapshot("with-deps")          # a template of its own: Sandbox.create(template="with-deps")

A non-zero exit is a result, not an exception. `SandboxError` means the sandbox itself is gone
(its VM died, expired or misbehaved) and has already been destroyed. The engine is its owner's
(`runner.service.host.assembly.ServiceHost`, a test, a benchmark), passed in: there is no global one.

Two modules: `port` names what crosses between the service and the VM layer (`VMRequest`,
`SandboxLike`, `SandboxProvider`) and loads nothing of the VM layer; `sandbox` is the Sandbox
itself and `EngineSandboxes`, the engine as a provider. The names load on first use (PEP 562), so
the service can import the port's types without QEMU's, the jail's or the network's modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.sandbox.port import (
        ExecResult,
        Resources,
        SandboxFactory,
        SandboxLike,
        SandboxProvider,
        VMRequest,
        needs_network,
    )
    from runner.sandbox.sandbox import EngineSandboxes, Sandbox, SandboxError

__all__ = ["EngineSandboxes", "ExecResult", "Resources", "Sandbox", "SandboxError", "SandboxFactory", "SandboxLike",
           "SandboxProvider", "VMRequest", "needs_network"]

_HOME = {
    "Resources": "port", "SandboxFactory": "port", "SandboxLike": "port", "SandboxProvider": "port",
    "VMRequest": "port", "needs_network": "port", "ExecResult": "port",
    "EngineSandboxes": "sandbox", "Sandbox": "sandbox", "SandboxError": "sandbox",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
