"""A stand-in for the VM engine's Sandbox, for tests of the service's own logic (queueing, cancel,
limits, hostile tars) that must run everywhere. It keeps the engine's contract: `destroy()` is
idempotent and makes a blocked `exec` raise; output arrives through `on_output` while exec runs.
What the "guest" does is a program the test chooses by the job's command. Real-VM tests live in
test_vm_e2e.py.
"""

from __future__ import annotations

import io
import itertools
import json
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy.suggest import AuditRecord
from runner.errors import CommandNotStarted
from runner.sandbox.port import VMRequest
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.job import AdmittedSpec
from runner.service.jobs.spec import parse_submission
from runner.vm import guestwire
from runner.vm.errors import SandboxError

SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class ExecResult:
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""
    duration_ms: float = 0.0
    timed_out: bool = False


Program = Callable[["FakeSandbox", Callable[[str, bytes], None], float], ExecResult]


@dataclass
class FakeEngine:
    programs: dict[str, Program] = field(default_factory=dict)
    artifacts_tar: bytes | None = None
    created: list[FakeSandbox] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    live: int = 0
    max_live: int = 0
    fail_create: bool = False
    unstartable: set[str] = field(default_factory=set)  # programs an argv cannot start: the guest's "not found"
    counter: itertools.count = field(default_factory=itertools.count)

    def create(self, request: VMRequest) -> FakeSandbox:
        if self.fail_create:
            raise SandboxError("the template could not be restored")
        with self.lock:
            sbx = FakeSandbox(self, f"vm{next(self.counter)}", request)
            self.created.append(sbx)
            self.live += 1
            self.max_live = max(self.max_live, self.live)
        return sbx

    def alive(self) -> list[FakeSandbox]:
        with self.lock:
            return [s for s in self.created if not s.destroyed.is_set()]


@dataclass
class FakeProvider:
    """A `SandboxProvider` with no templates: its sandboxes come from `create`, for tests of warm bases
    whose builds are stand-ins."""

    create: Callable[[VMRequest], Any]
    networked: bool = False

    def template(self, name: str) -> Any:
        return None

    def find_template(self, name: str) -> Any:
        return None

    def forget(self, name: str) -> None:
        pass

    def sandbox_snapshots(self) -> list[str]:
        return []

    def refill(self, template: Any, network: bool) -> None:
        pass

    def evict(self, budget_bytes: int, keep: frozenset[str] = frozenset()) -> list[str]:
        return []


class FakeSandbox:
    accel = "tcg"
    ready_ms = 1.0
    template_manifest: dict[str, object] = {}  # restored from no template the attestation could name

    def __init__(self, engine: FakeEngine, vm_id: str, request: VMRequest) -> None:
        self.engine, self.id, self.request = engine, vm_id, request
        self.files: dict[str, bytes] = {}
        self.destroyed = threading.Event()
        self.exec_calls: list[dict[str, Any]] = []
        self.get_tar_calls: list[tuple[list[str], str]] = []

    @property
    def alive(self) -> bool:
        return not self.destroyed.is_set()

    def put_tar(self, stream: Any, dest: str = "/workspace") -> None:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for info in tar:
                if info.isfile():
                    self.files[f"{dest}/{info.name}"] = tar.extractfile(info).read()

    def exec(self, command: list[str], timeout_seconds: float = 0, env: dict | None = None, cwd: str = "/",
             user: str | None = None, on_output: Callable[[str, bytes], None] | None = None,
             capture_bytes: int = 0) -> ExecResult:
        self.exec_calls.append({"command": command, "env": env, "cwd": cwd, "timeout": timeout_seconds})
        # a job's command comes as `sh -c COMMAND`, or as its words when the shell would only split them
        shell = command[:2] == ["sh", "-c"] and len(command) == 3
        if not shell and command[0] in self.engine.unstartable:
            raise CommandNotStarted(f"exec failed in the guest: cannot start {command[0]!r}: No such file or directory")
        program = self.engine.programs[command[2] if shell else " ".join(command)]
        result = program(self, on_output or (lambda s, d: None), timeout_seconds)
        if self.destroyed.is_set():
            raise SandboxError(f"VM {self.id} was destroyed")
        return result

    def get_tar(self, paths: list[str], out: Any, max_bytes: int, cwd: str = "/") -> int:
        self.get_tar_calls.append((paths, cwd))
        data = self.engine.artifacts_tar or b""
        if len(data) > max_bytes:  # the real agent also stops at the limit and reports an error
            raise SandboxError(f"the files exceed the {max_bytes}-byte limit")
        out.write(data)
        return len(data)

    def install_job_ca(self) -> dict[str, str]:
        return {}  # no policy here makes the host terminate TLS

    def blocked_egress(self) -> list[AuditRecord]:
        """What the real engine returns: runner.net's audit records."""
        return [AuditRecord(dest="192.0.2.7", port=443, proto="tcp", name="blocked.example", count=2),
                AuditRecord(dest="198.51.100.1", port=None, proto="icmp", name=None, count=1)]

    def destroy(self) -> None:
        with self.engine.lock:
            if self.destroyed.is_set():
                return
            self.destroyed.set()
            self.engine.live -= 1


# -- programs: what the fake guest does for a given command --------------------------------


def prints(text: bytes, exit_code: int = 0) -> Program:
    def run(sbx: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
        out("stdout", text)
        return ExecResult(exit_code, stdout=text)
    return run


def waits(release: threading.Event | None = None) -> Program:
    """Runs until `release` is set (exit 0), the VM is destroyed, or the timeout passes."""
    def run(sbx: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
        out("stdout", b"started\n")
        deadline_hit = True
        for _ in range(int(timeout * 100)):
            if sbx.destroyed.wait(0.01) or (release is not None and release.is_set()):
                deadline_hit = False
                break
        return ExecResult(124 if deadline_hit else 0, timed_out=deadline_hit)
    return run


def floods(total: int, chunk: int = 65536) -> Program:
    def run(sbx: FakeSandbox, out: Callable[[str, bytes], None], timeout: float) -> ExecResult:
        block = b"x" * chunk
        for _ in range(total // chunk):
            out("stdout", block)
        return ExecResult(0)
    return run


def tar_of(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def spec(command: str = "true", **fields: Any) -> dict[str, Any]:
    return {"repository": "octo/hello", "sha": SHA, "job_name": "test", "command": command, **fields}


def spec_as_sent(data: object, config: ServiceConfig) -> AdmittedSpec:
    """The spec a submission makes when the service decides nothing of it (the repository and runner as
    sent): what the spec's own checks give, without an admission's caller or policy store."""
    submitted = parse_submission(data, config)
    return submitted.spec(submitted.repository, submitted.runner_name)


def checkout_tar(files: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (files or {"README": b"hello\n"}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def baked_template(state_dir: Path, name: str = "base") -> None:
    """A template's record on disk as `template build` leaves it (manifest, current), for tests of `serve`'s
    start-up that never restore a VM from it: the host refuses to start without the templates its config offers."""
    from runner.vm.templates import TemplateStore

    store = TemplateStore(state_dir / "templates")
    path = store.begin(name, "d" * 20)
    (path / "manifest.json").write_text(json.dumps({"name": name, "digest": "d" * 20, "accel": "tcg",
                                                    "agent_ops": sorted(guestwire.OPS),
                                                    "memory_mib": 512, "created": 0, "variants": ["nonet"]}))
    store.publish(name, "d" * 20)
