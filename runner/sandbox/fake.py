"""The VM port's one fake, shipped beside it (as httpx ships MockTransport beside its transports).

Whatever sits above the port (the job service's queue, cancel, limits, hostile tars, the sandbox API,
warm bases) is tested and benchmarked anywhere, without root or QEMU, against this: `FakeSandboxes` is a
`SandboxProvider` (its `create` a `SandboxFactory`) whose `FakeSandbox`es are `SandboxLike`, so a stand-in
that drifts from the port fails the type check here rather than in each test's copy of it.

It keeps the contract the service relies on: `destroy()` is idempotent and makes a blocked `exec`
raise; output arrives through `on_output` while `exec` runs. What the "guest" does is scripted: each
command runs the `Program` the test gave for it (`prints`, `waits`, `floods`, or its own). Every call
is recorded (`created`, `exec_calls`, `get_tar_calls`, `files`, `snapshots`) for the test to read.
Nothing here runs a process or touches the network.
"""

from __future__ import annotations

import itertools
import tarfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

from runner.errors import CommandNotStarted, SandboxError, SandboxOpFailed
from runner.sandbox.port import AuditRecord, ExecResult, SandboxLike, SandboxProvider, VMRequest

if TYPE_CHECKING:
    from runner.net.secretswap import SecretSwap
    from runner.sandbox.terminal import Terminal
    from runner.vm.templates import Template

__all__ = ["FakeFiles", "FakeSandbox", "FakeSandboxes", "Program", "floods", "prints", "waits"]

Program = Callable[["FakeSandbox", Callable[[str, bytes], None], float], ExecResult]
"""What the guest does for one command: given its sandbox, the output sink and the timeout, a result."""


class FakeFiles(dict[str, bytes]):
    """The guest's files by path, as `put_tar` unpacked and `files.write` wrote them: a dict to read."""

    def write(self, path: str, data: bytes | BinaryIO, mode: int = 0o644) -> None:
        self[path] = data if isinstance(data, bytes) else data.read()

    def read(self, path: str, max_bytes: int = 256 * 1024 * 1024) -> bytes:
        if path not in self:
            raise SandboxOpFailed(f"read_file failed in the guest: {path}: No such file or directory")
        return self[path][:max_bytes]


@dataclass
class FakeSandboxes:
    """A provider of fake sandboxes: `programs` by command, the tar `get_tar` answers (`artifacts_tar`), the
    egress its guests were refused (`blocked`), `fail_create` to refuse restores and `unstartable` argv[0]s
    (the guest's "not found"). It has no templates: a warm base's build runs in its sandboxes, but
    `template` names none; `manifest` is what its sandboxes say their build's manifest is ({}: none)."""

    programs: dict[str, Program] = field(default_factory=dict)
    artifacts_tar: bytes | None = None
    blocked: Sequence[AuditRecord] = ()
    fail_create: bool = False
    unstartable: set[str] = field(default_factory=set)
    networked: bool = False
    manifest: dict[str, object] = field(default_factory=dict)
    created: list[FakeSandbox] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: int = 0
    max_live: int = 0  # the most alive at once
    counter: itertools.count[int] = field(default_factory=itertools.count)

    def create(self, request: VMRequest) -> FakeSandbox:
        if self.fail_create:
            raise SandboxError("the template could not be restored")
        with self.lock:
            sandbox = FakeSandbox(self, f"vm{next(self.counter)}", request)
            self.created.append(sandbox)
            self.live += 1
            self.max_live = max(self.max_live, self.live)
        return sandbox

    def alive(self) -> list[FakeSandbox]:
        with self.lock:
            return [s for s in self.created if not s.destroyed.is_set()]

    def template(self, name: str) -> Template:
        raise SandboxError(f"template {name!r}: a fake provider has no templates")

    def find_template(self, name: str) -> Template | None:
        return None

    def forget(self, name: str) -> None:
        pass

    def remove(self, name: str) -> None:
        pass

    def sandbox_snapshots(self) -> list[str]:
        return []

    def refill(self, template: Template, network: bool) -> None:
        pass

    def evict(self, budget_bytes: int, keep: frozenset[str] = frozenset()) -> list[str]:
        return []


class FakeSandbox:
    """One fake VM: runs its provider's programs, keeps its files in memory and records each call."""

    accel = "tcg"
    ready_ms = 1.0

    def __init__(self, engine: FakeSandboxes, vm_id: str, request: VMRequest) -> None:
        self.engine, self.id, self.request = engine, vm_id, request
        self.files = FakeFiles()
        self.destroyed = threading.Event()
        self.exec_calls: list[dict[str, object]] = []
        self.get_tar_calls: list[tuple[list[str], str]] = []
        self.snapshots: list[str] = []
        self.network_cut = False  # cut_network was called (a VM kept for debugging)

    @property
    def alive(self) -> bool:
        return not self.destroyed.is_set()

    @property
    def template_manifest(self) -> dict[str, object] | None:
        return self.engine.manifest

    def put_tar(self, stream: BinaryIO, dest: str = "/workspace") -> None:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for info in tar:
                member = tar.extractfile(info) if info.isfile() else None
                if member is not None:
                    self.files[f"{dest}/{info.name}"] = member.read()

    def exec(self, command: str | list[str], timeout_seconds: float | None = None, env: dict[str, str] | None = None,
             cwd: str = "/workspace", user: str | None = None, on_output: Callable[[str, bytes], None] | None = None,
             capture_bytes: int = 0, stdin: bytes | None = None) -> ExecResult:
        """Run the program scripted for `command`: a job's `sh -c COMMAND` by COMMAND, an argv by its words
        joined, a string as it is (its `stdin`, when given, is recorded with the call)."""
        self.exec_calls.append({"command": command, "env": env, "cwd": cwd, "timeout": timeout_seconds,
                                **({"stdin": stdin} if stdin is not None else {})})
        shell = isinstance(command, list) and command[:2] == ["sh", "-c"] and len(command) == 3
        if isinstance(command, list) and not shell and command[0] in self.engine.unstartable:
            raise CommandNotStarted(f"exec failed in the guest: cannot start {command[0]!r}: No such file or directory")
        key = command if isinstance(command, str) else command[2] if shell else " ".join(command)
        result = self.engine.programs[key](self, on_output or (lambda stream, data: None), timeout_seconds or 0.0)
        if self.destroyed.is_set():
            raise SandboxError(f"VM {self.id} was destroyed")
        return result

    def get_tar(self, paths: list[str], out: BinaryIO, max_bytes: int, cwd: str = "/") -> int:
        self.get_tar_calls.append((paths, cwd))
        data = self.engine.artifacts_tar or b""
        if len(data) > max_bytes:  # the real agent also stops at the limit and reports an error
            raise SandboxError(f"the files exceed the {max_bytes}-byte limit")
        out.write(data)
        return len(data)

    def terminal(self, argv: list[str], cwd: str = "/workspace", env: dict[str, str] | None = None,
                 size: tuple[int, int] = (24, 80), timeout_seconds: float = 3600.0,
                 user: str | None = None) -> Terminal:
        raise SandboxError("a fake sandbox has no terminal: attach to a real VM (tests/e2e/test_vm_attach.py)")

    def blocked_egress(self) -> list[AuditRecord]:
        return list(self.engine.blocked)

    def install_job_ca(self) -> dict[str, str]:
        return {}  # no policy here makes the host terminate TLS

    def bind_secrets(self, swap: SecretSwap) -> dict[str, str]:
        return {}

    def secret_uses(self) -> dict[str, int]:
        return {}

    def cut_network(self) -> None:
        self.network_cut = True

    def snapshot(self, name: str, *, digest: str | None = None, extra: dict[str, object] | None = None) -> str:
        """A template of nothing but its name (a fork restores from a fake sandbox again)."""
        self.snapshots.append(name)
        return name

    def destroy(self) -> None:
        with self.engine.lock:
            if self.destroyed.is_set():
                return
            self.destroyed.set()
            self.engine.live -= 1


# -- programs: what the fake guest does for a command ----------------------------------------------


def prints(text: bytes, exit_code: int = 0) -> Program:
    """Writes `text` to stdout and exits with `exit_code`."""
    def run(sandbox: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
        out("stdout", text)
        return ExecResult(exit_code, stdout=text, stderr=b"", duration_ms=0.0, timed_out=False)
    return run


def waits(release: threading.Event | None = None) -> Program:
    """Runs until `release` is set (exit 0), the VM is destroyed, or the timeout passes (124, timed out)."""
    def run(sandbox: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
        out("stdout", b"started\n")
        deadline_hit = True
        for _ in range(int(timeout * 100)):
            if sandbox.destroyed.wait(0.01) or (release is not None and release.is_set()):
                deadline_hit = False
                break
        return ExecResult(124 if deadline_hit else 0, stdout=b"", stderr=b"", duration_ms=0.0, timed_out=deadline_hit)
    return run


def floods(total: int, chunk: int = 65536) -> Program:
    """Writes `total` bytes to stdout in `chunk`s, then exits 0."""
    def run(sandbox: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
        block = b"x" * chunk
        for _ in range(total // chunk):
            out("stdout", block)
        return ExecResult(0, stdout=b"", stderr=b"", duration_ms=0.0, timed_out=False)
    return run


if TYPE_CHECKING:  # the fake is the port's: the type check holds it to the protocols (nothing here runs)
    _PROVIDER: SandboxProvider = FakeSandboxes()
    _SANDBOX: SandboxLike = FakeSandbox(FakeSandboxes(), "vm0", VMRequest())
