"""microvm-check's client SDK: sandboxes of a running service, for review bots and audit agents.

    from microvm_check import Sandbox

    with Sandbox.create(template="base", ttl_seconds=600) as sbx:     # MICROVM_CHECK_SOCKET or the default socket
        sbx.upload("checkout/", dest="/workspace")
        result = sbx.exec("pytest -q", timeout=300, on_output=lambda stream, data: print(data.decode(), end=""))
        report = sbx.download("report.xml")                          # a tar, checked by the service

It needs no root: the service decides (its `sandboxes:` config section) who may create sandboxes, as
which repository and with which egress, and destroys each at its TTL. `AsyncSandbox` is the same for
asyncio. To run a VM inside your own root process instead (tests, benchmarks), use the in-process
`runner.sandbox.Sandbox` with an engine of your own.

The names below are loaded when first used: the service imports `microvm_check.contract` (the sandbox
API's contract, standard library only) and `microvm_check.entries` (an exec's and a job record's
blocked-egress `AuditRecord`, the record's `Artifact`), and that must not load the clients and httpx into it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from microvm_check._wire import ExecResult, SandboxError, Service
    from microvm_check.aio import AsyncSandbox, AsyncTerminal
    from microvm_check.client import Sandbox, Terminal
    from microvm_check.contract import FileEntry, SandboxInfo, TerminalEnd
    from microvm_check.entries import AuditRecord

_HOMES = {"AsyncSandbox": "aio", "AsyncTerminal": "aio", "AuditRecord": "entries", "ExecResult": "_wire",
          "FileEntry": "contract", "Sandbox": "client", "SandboxError": "_wire", "SandboxInfo": "contract",
          "Service": "_wire", "Terminal": "client", "TerminalEnd": "contract"}
__all__ = ["AsyncSandbox", "AsyncTerminal", "AuditRecord", "ExecResult", "FileEntry", "Sandbox", "SandboxError",
           "SandboxInfo", "Service", "Terminal", "TerminalEnd"]


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
