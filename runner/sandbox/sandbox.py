"""The Sandbox: a fresh microVM per use, in the shape users of sandbox SDKs know (`runner.sandbox`
documents it), and `EngineSandboxes`, the engine as the service's `SandboxProvider`."""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeGuard, TypeVar

from policy.model import Policy
from policy.suggest import AuditRecord
from runner import tarsafe
from runner.errors import CommandNotStarted, SandboxOpFailed
from runner.net.secretswap import SecretSwap
from runner.sandbox.netclaim import claim_network, cut_network
from runner.sandbox.port import ExecResult, Resources, VMRequest
from runner.sandbox.terminal import Terminal
from runner.vm import checkoutdisk
from runner.vm.agent import AgentClient, GuestOpError, NotStarted
from runner.vm.engine import Engine
from runner.vm.errors import AgentError, SandboxError
from runner.vm.templates import Template, TemplateNotFound
from runner.vm.vm import VM

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["EngineSandboxes", "ExecResult", "Sandbox", "SandboxError"]

CAPTURE_LIMIT = 16 * 1024 * 1024  # per stream kept in ExecResult; on_output still sees everything
FILE_TIMEOUT_S = 600.0
STREAM_CHUNK = 1024 * 1024

T = TypeVar("T")
# Where the job's CA certificate goes in the guest (Debian's layout: update-ca-certificates' input
# directory, and the bundle every OpenSSL-based client there reads).
JOB_CA_FILE = "/usr/local/share/ca-certificates/microvm-check-job.crt"
GUEST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


class _Capture:
    def __init__(self, on_output: Callable[[str, bytes], None] | None, limit: int) -> None:
        self.on_output = on_output
        self.limit = limit
        self.parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.sizes = {"stdout": 0, "stderr": 0}
        self.truncated = False
        self.raised = False  # on_output raised: the caller gave up on this command

    def __call__(self, stream: str, data: bytes) -> None:
        if self.on_output is not None:
            try:
                self.on_output(stream, data)
            except BaseException:
                self.raised = True
                raise
        room = self.limit - self.sizes[stream]
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        if data:
            self.parts[stream].append(data)
            self.sizes[stream] += len(data)

    def text(self, stream: str) -> bytes:
        return b"".join(self.parts[stream])


class Files:
    """Single files in the guest."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sbx = sandbox

    def write(self, path: str, data: bytes | BinaryIO, mode: int = 0o644) -> None:
        """`data`: the bytes, or a file streamed from where it stands to its end (the API's spool)."""
        if isinstance(data, bytes):
            chunks: Iterable[bytes] = _slices(data)
        else:
            source = data
            chunks = iter(lambda: source.read(STREAM_CHUNK), b"")
        self._sbx._call(lambda a: a.write_file(path, chunks, mode, FILE_TIMEOUT_S))

    def read(self, path: str, max_bytes: int = 256 * 1024 * 1024) -> bytes:
        return self._sbx._call(lambda a: a.read_file(path, max_bytes, FILE_TIMEOUT_S))


class Sandbox:
    def __init__(self, engine: Engine, vm: VM) -> None:
        self._engine = engine
        self._vm = vm
        self.files = Files(self)

    @classmethod
    def create(
        cls,
        template: str = "base",
        ttl_seconds: float = 600.0,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        network: bool | None = None,
        policy: Policy | None = None,
        job_id: str | None = None,
        *,
        engine: Engine,
    ) -> Sandbox:
        """Restore a fresh VM. It has a network card when its policy allows something (or audits:
        `runner.sandbox.needs_network`), or when network=True asks for one; a card without a policy
        is deny-all."""
        request = VMRequest(template=template, ttl_seconds=ttl_seconds, resources=Resources(vcpus, memory_mib),
                            policy=policy, job_id=job_id, network_card=network)
        return cls.open(request, engine)

    @classmethod
    def open(cls, request: VMRequest, engine: Engine) -> Sandbox:
        """Restore the VM `request` asks for on `engine`, then claim its network for the request (its
        egress policy: `runner.sandbox.netclaim`). Its `ready_ms` counts both: the job waits for both."""
        started = time.monotonic()
        vm = engine.create(request)
        try:
            claim_network(vm, request)
        except BaseException:
            engine.destroy(vm)
            raise
        vm.ready_ms = (time.monotonic() - started) * 1000  # as before the claim left the engine
        return cls(engine, vm)

    # ---- facts -------------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self._vm.id

    @property
    def ready_ms(self) -> float:
        return self._vm.ready_ms

    @property
    def accel(self) -> str:
        return self._vm.snapshot.config.accel

    @property
    def alive(self) -> bool:
        return not self._vm.destroyed

    @property
    def template_manifest(self) -> dict[str, object] | None:
        """The manifest of the build this VM restored from (`<name>/<digest>/manifest.json` above its
        snapshot's variant directory), so a template rebuilt while the job runs does not change the answer:
        its name and digest and, for a derived one (a warm base), its parent's; None when that build's
        directory went away (a template removed under a running VM)."""
        try:
            manifest = self._engine.templates.owner(self._vm.snapshot).manifest
        except (OSError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

    # ---- running -----------------------------------------------------------------------------
    def _call(self, fn: Callable[[AgentClient], T]) -> T:
        """Run an agent operation; a broken channel or dead VM becomes a SandboxError after cleanup, an
        operation the guest refused (the channel fine) a SandboxOpFailed."""
        vm = self._vm
        if vm.destroyed or vm.agent is None:
            raise SandboxError(vm.describe_failure())
        try:
            return fn(vm.agent)
        except NotStarted as exc:
            raise CommandNotStarted(str(exc)) from None
        except GuestOpError as exc:
            raise SandboxOpFailed(str(exc)) from None
        except AgentError as exc:
            vm.channel_broken(str(exc))
            self._engine.destroy(vm)
            raise SandboxError(vm.describe_failure()) from None

    def exec(
        self,
        command: str | list[str],
        timeout_seconds: float | None = None,
        env: dict[str, str] | None = None,
        cwd: str = "/workspace",
        user: str | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        capture_bytes: int = CAPTURE_LIMIT,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run `command` (a shell string, or an argv list run without a shell) and wait for it.

        At most `capture_bytes` of each stream are kept in the result (0 when `on_output` already
        takes care of the output); `on_output` sees all of it, as it comes, small writes merged
        (up to 64 KiB, at most 50 ms late). An exception from `on_output` (a log that is full)
        ends the call with that exception and destroys the sandbox: the command would otherwise
        run on with nobody reading its output. `stdin` is the command's whole input (else it reads
        an empty one), in the guest before it starts.
        """
        message: dict[str, object] = {"cwd": cwd, "env": dict(env or {}), "user": user}
        if isinstance(command, str):
            message["shell"] = command
        else:
            message["argv"] = [str(a) for a in command]
        capture = _Capture(on_output, capture_bytes)
        started = _now_ms()
        try:
            input_chunks = None if stdin is None else _slices(stdin)
            outcome = self._call(lambda a: a.exec(message, capture, timeout_seconds, input_chunks))
        except BaseException:
            if capture.raised:
                self.destroy()
            raise
        return ExecResult(
            exit_code=124 if outcome.timed_out else outcome.exit_code,
            stdout=capture.text("stdout"),
            stderr=capture.text("stderr"),
            duration_ms=_now_ms() - started,
            timed_out=outcome.timed_out,
            truncated=capture.truncated,
        )

    def terminal(self, argv: list[str], cwd: str = "/workspace", env: dict[str, str] | None = None,
                 size: tuple[int, int] = (24, 80), timeout_seconds: float = 3600.0, user: str | None = None) -> Terminal:
        """Start `argv` on a terminal of its own in the guest (`size`: rows, columns), killed with whatever
        it started when it exits, when the Terminal is closed, or past `timeout_seconds`; the caller
        streams it (runner.sandbox.terminal) and closes it. The sandbox runs on after it."""
        pty = self._call(lambda a: a.pty(argv, cwd, dict(env or {}), size, timeout_seconds, user))
        return Terminal(self, pty)

    def cancel(self) -> None:
        """Kill every command running in the sandbox (their exec calls return killed results)."""
        self._call(AgentClient.kill_all)

    # ---- files -------------------------------------------------------------------------------
    def put_tar(self, stream: BinaryIO | Iterable[bytes], dest: str = "/workspace") -> None:
        """Unpack a tar stream into `dest` in the guest, links and modes kept.

        The first one (the checkout) is unpacked on the host into a disk image that the guest
        mounts under `dest` (runner/vm/checkoutdisk.py); the VM has one drive for that, so any
        later one (or one for a `dest` an overlay cannot be mounted on) is unpacked by the guest
        agent itself, at a fraction of the speed."""
        vm = self._vm
        if vm.checkout_drive_used or not checkoutdisk.mountable(dest):
            chunks = _chunks(stream) if _is_file(stream) else stream
            self._call(lambda a: a.put_tar(dest, chunks, FILE_TIMEOUT_S))
            return
        reader = stream if _is_file(stream) else io.BufferedReader(_IterReader(stream), STREAM_CHUNK)
        self._call(lambda a: checkoutdisk.put_checkout(vm, reader, dest))

    def get_tar(self, paths: list[str], out: BinaryIO, max_bytes: int, cwd: str = "/") -> int:
        """Write a tar stream of guest paths (globs, relative to cwd) to `out`; bytes written."""
        return self._call(lambda a: a.get_tar(paths, cwd, out, max_bytes, FILE_TIMEOUT_S))

    def copy_in(self, local_dir: str | os.PathLike[str], dest: str) -> None:
        """Copy a host directory's contents into `dest` in the guest, byte-exact."""
        self.put_tar(_tar_directory(Path(local_dir)), dest)

    def copy_out(
        self, guest_path: str, local_dir: str | os.PathLike[str], max_bytes: int = 1024**3
    ) -> tarsafe.Extracted:
        """Copy a guest file or directory into `local_dir`, checking every name on the host.

        Links in the guest are not copied (listed with the reason in the result's `skipped`): a link
        written on the host is how a guest would reach outside `local_dir`.
        """
        parent, name = os.path.split(guest_path.rstrip("/"))
        read_fd, write_fd = os.pipe()
        result = _Unpacked()

        def unpack() -> None:
            with os.fdopen(read_fd, "rb") as reader:
                try:
                    result.extracted = tarsafe.extract(reader, Path(local_dir), tarsafe.Limits(max_total_bytes=max_bytes))
                except tarsafe.UnsafeTar as exc:
                    result.error = f"refused the guest's files from {guest_path}: {exc}"
                except Exception as exc:
                    result.error = f"could not copy {guest_path} into {local_dir}: {exc}"
                finally:
                    # Drain in bounded chunks so the writer never blocks on a reader that gave up,
                    # without holding the rest of a guest-sized stream in memory.
                    while reader.read(STREAM_CHUNK):
                        pass

        worker = threading.Thread(target=unpack, daemon=True)
        worker.start()
        try:
            with os.fdopen(write_fd, "wb") as writer:
                self.get_tar([name], writer, max_bytes=max_bytes * 2 + 1024**2, cwd=parent or "/")
        finally:
            worker.join()
        if result.error is not None:
            raise SandboxError(result.error)
        assert result.extracted is not None, "unpack() sets one of the two unless it died of a BaseException"
        return result.extracted

    def install_job_ca(self) -> dict[str, str]:
        """Put the job's CA certificate (runner.net.jobca; never its key) into the guest's trust:
        the system bundle, which Debian's OpenSSL, Python, pip, curl and git read, and the variables
        that point the others at it. Returns those variables for the job's commands; {} (and nothing
        written) when the policy makes the host read no HTTPS (no `methods:`/`paths:` rule)."""
        slot = self._vm.slot
        ca = slot.proxy.ca if slot is not None and slot.proxy is not None else None
        if ca is None:
            return {}
        _write_job_ca(self, ca.cert_pem)
        # as root: an image template's commands run as the image's USER unless told otherwise
        added = self.exec(["sh", "-c", f"cat {JOB_CA_FILE} >> {GUEST_CA_BUNDLE}"], timeout_seconds=60, cwd="/",
                          user="root")
        if added.exit_code != 0:
            raise SandboxError(f"could not add the job's CA to {GUEST_CA_BUNDLE}: {added.stderr[-500:]!r}")
        bundle = {name: GUEST_CA_BUNDLE for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT",
                                                     "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "NPM_CONFIG_CAFILE")}
        return {**bundle, "NODE_EXTRA_CA_CERTS": JOB_CA_FILE}

    def bind_secrets(self, swap: SecretSwap) -> dict[str, str]:
        """Bind the job's secrets in its VM's network (runner.net.secretswap): the host swaps each value
        into the requests its binding admits and refuses its placeholder everywhere else. Call before
        `install_job_ca` (the job's CA is made again to vouch for the bound hosts) and before any job
        code runs. Returns the variables that hold the placeholders; no value ever enters the guest."""
        slot = self._vm.slot
        if slot is None:
            raise SandboxError("secrets are bound only in a VM with a network card; the job's policy allows nothing "
                               f"(bindings: {', '.join(bound.binding.name for bound in swap.secrets)})")
        slot.bind_secrets(swap)
        return {bound.binding.env: bound.placeholder for bound in swap.secrets}

    def cut_network(self) -> None:
        """Its network denies everything from now on (runner.sandbox.netclaim `cut_network`): a job's VM
        kept for the operator after it failed. A SandboxError when the slot's rules cannot be loaded."""
        cut_network(self._vm)

    def secret_uses(self) -> dict[str, int]:
        slot = self._vm.slot
        return {} if slot is None else slot.secret_uses()

    def blocked_egress(self) -> list[AuditRecord]:
        """What the guest tried that its policy does not allow (in audit mode: would not allow)."""
        slot = self._vm.slot
        return [] if slot is None else slot.audit_records()

    # ---- templates ---------------------------------------------------------------------------
    def snapshot(self, name: str, *, digest: str | None = None, extra: dict[str, object] | None = None) -> str:
        """Make template `name` from this sandbox as it is now, for `Sandbox.create(template=name)`.

        Safe on a VM that is busy writing: the guest's disks are synced and its page cache dropped
        first, then it is left quiet a moment before its memory and disk are copied. The sandbox
        runs on afterwards, without its checkout (the medium is a job's, never a template's:
        `put_tar` may insert another one). Every restore from the template gets a fresh identity
        (RNG reseed, clock, hostname). `digest` keys the template (a new one by default), `extra`
        goes into its manifest. Returns the template's digest."""
        vm = self._vm
        if vm.destroyed:
            raise SandboxError(vm.describe_failure())
        try:
            return self._engine.snapshot(vm, name, digest=digest, extra=extra).digest
        except AgentError as exc:
            vm.channel_broken(str(exc))
            self._engine.destroy(vm)
            raise SandboxError(vm.describe_failure()) from None

    # ---- ending ------------------------------------------------------------------------------
    def destroy(self) -> None:
        self._engine.destroy(self._vm)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def _write_job_ca(sandbox: Sandbox, pem: bytes) -> None:
    """Write the job's CA at JOB_CA_FILE. An image template's root may lack its directory and the bundle's
    (a busybox image has neither, docs/images.md): they are made then, as root, and the write tried once more."""
    try:
        sandbox.files.write(JOB_CA_FILE, pem)
        return
    except SandboxOpFailed:
        pass
    directories = [os.path.dirname(JOB_CA_FILE), os.path.dirname(GUEST_CA_BUNDLE)]
    made = sandbox.exec(["mkdir", "-p", *directories], timeout_seconds=60, cwd="/", user="root")
    if made.exit_code != 0:
        raise SandboxError(f"could not make {' and '.join(directories)} for the job's CA: {made.stderr[-500:]!r}")
    sandbox.files.write(JOB_CA_FILE, pem)


class EngineSandboxes:
    """The engine as the service's `SandboxProvider`: sandboxes from requests, its templates as the
    service may see them, and its spare VMs kept in step with them. The one object that joins the
    service to the engine's parts (its slot pool, template store and spare-VM pool)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def networked(self) -> bool:
        return self.engine.net is not None

    def create(self, request: VMRequest) -> Sandbox:
        return Sandbox.open(request, self.engine)

    def template(self, name: str) -> Template:
        return self.engine.template(name)

    def find_template(self, name: str) -> Template | None:
        try:
            return self.engine.templates.get(name)
        except (TemplateNotFound, OSError, ValueError):
            return None

    def forget(self, name: str) -> None:
        self.engine.forget_template(name)

    def remove(self, name: str) -> None:
        self.forget(name)
        self.engine.templates.remove(name)

    def sandbox_snapshots(self) -> list[str]:
        return [t.name for t in self.engine.templates.list() if t.sandbox and self.engine.is_leftover(t)]

    def refill(self, template: Template, network: bool) -> None:
        self.engine.pool.refill(template.snapshot(network))

    def evict(self, budget_bytes: int, keep: frozenset[str] = frozenset()) -> list[str]:
        return self.engine.templates.evict(budget_bytes, keep=keep, before_remove=self.forget)


@dataclass
class _Unpacked:
    """What copy_out's unpacking thread ends with: the files it wrote, or why it stopped."""

    extracted: tarsafe.Extracted | None = None
    error: str | None = None


def _is_file(stream: BinaryIO | Iterable[bytes]) -> TypeGuard[BinaryIO]:
    """put_tar takes a readable file or an iterable of chunks; a file is whatever has `read`."""
    return hasattr(stream, "read")


def _slices(data: bytes) -> Iterator[bytes]:
    return (data[i : i + STREAM_CHUNK] for i in range(0, len(data), STREAM_CHUNK))


def _now_ms() -> float:
    return time.monotonic() * 1000


def _chunks(stream: BinaryIO) -> Iterator[bytes]:
    while chunk := stream.read(STREAM_CHUNK):
        yield chunk


class _IterReader(io.RawIOBase):
    """Chunks from an iterable as a readable file, for the tar reader."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer)  # RawIOBase.read hands a bytearray or a memoryview of bytes
        while not self._pending:
            self._pending = next(self._chunks, b"")
            if not self._pending:
                return 0
        n = min(len(view), len(self._pending))
        view[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _tar_directory(root: Path) -> Iterator[bytes]:
    """Stream a tar of `root`'s contents without holding it in memory."""
    read_fd, write_fd = os.pipe()

    def produce() -> None:
        with os.fdopen(write_fd, "wb") as writer:
            try:
                with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    for entry in sorted(root.iterdir()):
                        tar.add(entry, arcname=entry.name)
            except BrokenPipeError:
                pass

    threading.Thread(target=produce, daemon=True).start()
    with os.fdopen(read_fd, "rb") as reader:
        yield from _chunks(reader)
