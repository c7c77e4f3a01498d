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
"""

from microvm_check._wire import ExecResult, SandboxError, Service
from microvm_check.aio import AsyncSandbox
from microvm_check.client import Sandbox
from microvm_check.contract import FileEntry, SandboxInfo

__all__ = ["AsyncSandbox", "ExecResult", "FileEntry", "Sandbox", "SandboxError", "SandboxInfo", "Service"]
