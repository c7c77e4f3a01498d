"""A stand-in for the VM engine that runs the job's command as a local process in a temp directory.

Only for end-to-end tests of the action's own path (action.yml -> entry point -> real job service over
its real Unix socket -> back) on machines without QEMU: it isolates nothing, so the hostile-guest
tests run only against real VMs (test_action_vm_e2e.py). It keeps the engine's contract the service
relies on: output through `on_output` while the command runs, `destroy()` idempotent and ending a
running command, artifacts as a tar of names relative to the job's working directory.
"""

from __future__ import annotations

import glob
import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from microvm_check.entries import AuditRecord

# Debian 12's Python 3.11.2 predates extraction filters; where they exist, use the strictest.
_DATA_FILTER = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


@dataclass
class LocalResult:
    exit_code: int
    timed_out: bool = False


class LocalSandboxError(Exception):
    pass


class LocalEngine:
    def __init__(self) -> None:
        self.created: list[LocalSandbox] = []

    def create(self, request: Any) -> LocalSandbox:
        sandbox = LocalSandbox(f"local{len(self.created)}", request)
        self.created.append(sandbox)
        return sandbox


class LocalSandbox:
    ready_ms = 0.0
    accel = "none"
    template_manifest: dict[str, object] = {}

    def __init__(self, sandbox_id: str, request: Any) -> None:
        self.id = sandbox_id
        self.request = request
        self.root = Path(tempfile.mkdtemp(prefix="mvc-act-guest-"))
        (self.root / "workspace").mkdir()
        self.process: subprocess.Popen | None = None
        self.destroyed = threading.Event()

    @property
    def alive(self) -> bool:
        return not self.destroyed.is_set()

    def _host(self, guest_path: str) -> Path:
        return self.root / guest_path.lstrip("/")

    def put_tar(self, stream: Any, dest: str = "/workspace") -> None:
        with tarfile.open(fileobj=stream, mode="r|") as archive:
            archive.extractall(self._host(dest), **_DATA_FILTER)

    def exec(self, command: str | list[str], timeout_seconds: float = 0, env: dict | None = None, cwd: str = "/",
             on_output: Callable[[str, bytes], None] | None = None, **_: Any) -> LocalResult:
        argv = command if isinstance(command, list) else ["sh", "-c", command]
        self.process = subprocess.Popen(
            argv, cwd=self._host(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "HOME": str(self.root), **(env or {})}, start_new_session=True,
        )
        readers = [threading.Thread(target=self._pump, args=(pipe, name, on_output))
                   for pipe, name in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr"))]
        for reader in readers:
            reader.start()
        try:
            code = self.process.wait(timeout=timeout_seconds or None)
            timed_out = False
        except subprocess.TimeoutExpired:
            self._kill()
            code, timed_out = 124, True
        for reader in readers:
            reader.join()
        if self.destroyed.is_set():
            raise LocalSandboxError(f"sandbox {self.id} was destroyed")
        return LocalResult(code, timed_out)

    @staticmethod
    def _pump(pipe: Any, name: str, on_output: Callable[[str, bytes], None] | None) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            if on_output:
                on_output(name, chunk)

    def get_tar(self, patterns: list[str], out: Any, max_bytes: int, cwd: str = "/") -> int:
        base = self._host(cwd)
        matches = sorted({m for p in patterns for m in glob.glob(str(base / p), recursive=True)})
        if not matches:
            return 0
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as archive:
            for match in matches:
                archive.add(match, arcname=os.path.relpath(match, base))
        data = buf.getvalue()
        if len(data) > max_bytes:
            raise LocalSandboxError(f"artifacts larger than {max_bytes} bytes")
        out.write(data)
        return len(data)

    def blocked_egress(self) -> list[AuditRecord]:
        return []

    def install_job_ca(self) -> dict[str, str]:
        return {}

    def cut_network(self) -> None:
        pass  # a local sandbox has no network of its own to cut

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)

    def destroy(self) -> None:
        if self.destroyed.is_set():
            return
        self.destroyed.set()
        self._kill()
        shutil.rmtree(self.root, ignore_errors=True)
