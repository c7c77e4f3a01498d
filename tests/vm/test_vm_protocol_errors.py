"""Guest protocol errors are counted: by the agent channel (its kind), by the engine (VMs destroyed for one)
and in the service's /metrics. The guest is played on a socketpair; no QEMU runs (qemu-img makes the overlay)."""

from __future__ import annotations

import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runner.service.config.reading import config_from_mapping
from runner.service.host.assembly import EngineSettings, ServiceHost
from runner.vm import guestwire as P
from runner.vm.agent import MAX_STRAY_FRAMES, AgentClient
from runner.vm.engine import Engine
from runner.vm.errors import AgentError
from runner.vm.hypervisor import Disk, MachineConfig, Snapshot
from runner.vm.statedir import StateDir
from tests.service.service_fakes import baked_template

TOKEN = "a-test-token-of-32-characters-xx"
BAD_MAGIC = P.HEADER.pack(b"XXXX", P.VERSION, P.MSG, 1, 2) + b"{}"
NOT_JSON = P.encode(P.MSG, 1, b"{not json")


def _channel(on_protocol_error, on_broken) -> tuple[AgentClient, socket.socket]:
    host, guest = socket.socketpair()
    return AgentClient(host, on_broken=on_broken, on_protocol_error=on_protocol_error), guest


def _read_request(guest: socket.socket) -> None:
    P.FrameReader(guest.recv).next()


@pytest.mark.parametrize(("kind", "reply"), [
    ("frame", BAD_MAGIC),
    ("decode", NOT_JSON),
    ("flood", P.encode_msg(1, {"ok": True})),  # then the frames for the ended request
])
def test_the_channel_reports_the_kind_of_protocol_error(kind: str, reply: bytes) -> None:
    kinds: list[str] = []
    broken: list[str] = []
    client, guest = _channel(kinds.append, broken.append)
    try:
        def guest_side() -> None:
            _read_request(guest)
            guest.sendall(reply)

        threading.Thread(target=guest_side, daemon=True).start()
        if kind == "flood":
            client.ping(timeout=30)
            guest.sendall(P.encode(P.STDOUT, 1, b"late") * (MAX_STRAY_FRAMES + 1))
        else:
            with pytest.raises(AgentError, match="broke the protocol"):
                client.ping(timeout=30)
        assert client.broken_event.wait(30), "the reader never marked the channel broken"
        assert kinds == [kind]  # reported before the channel was seen broken, once
        assert broken and "broke the protocol" in broken[0]
    finally:
        client.close()
        guest.close()


def test_a_channel_that_ends_without_a_protocol_error_reports_none() -> None:
    kinds: list[str] = []
    broken: list[str] = []
    client, guest = _channel(kinds.append, broken.append)
    guest.close()  # the guest hangs up: broken, but the protocol was kept
    assert client.broken_event.wait(30)
    client.close()
    assert broken == ["the guest closed its agent channel"] and kinds == []


class HostileMachine:
    """A VMM stand-in whose guest, once resumed, answers the agent channel with a frame of bad magic."""

    pid = 0

    def __init__(self) -> None:
        self.agent, self._guest = socket.socketpair()
        self.running = True

    def restore(self, snapshot: Snapshot) -> None:
        pass

    def resume(self) -> None:
        self._guest.sendall(BAD_MAGIC)

    def alive(self) -> bool:
        return self.running

    def kill(self) -> None:
        self.running = False
        self._guest.close()

    def exit_status(self) -> int | None:
        return None if self.running else -9


class HostileHypervisor:
    def __init__(self) -> None:
        self.machines: list[HostileMachine] = []

    def spawn(self, snapshot: Snapshot, launch) -> HostileMachine:
        self.machines.append(HostileMachine())
        return self.machines[-1]

    def overlay(self, base: Path, vm_dir: Path) -> Disk:
        """A plain copy (the Hypervisor interface's non-QEMU way): the hostile guest never reads it."""
        shutil.copyfile(base, vm_dir / "disk.img")
        return Disk(vm_dir / "disk.img", "raw")


def _snapshot(directory: Path) -> Snapshot:
    disk = directory / "disk.img"
    disk.write_bytes(b"\0" * 1024 * 1024)
    config = MachineConfig(kernel=directory / "vmlinuz", initrd=directory / "initrd.img", cmdline="", memory_mib=64,
                           vcpus=1, network=False, accel="tcg")
    return Snapshot(config=config, mem_file=directory / "mem.ram", state_file=directory / "state.bin", disk=disk)


def _restore_hostile(engine: Engine, snapshot: Snapshot) -> None:
    """Restore a VM whose guest breaks the protocol: the restore fails and the VM is gone."""
    with pytest.raises(AgentError, match=re.escape("bad frame magic")):
        engine._restore(snapshot)
    assert engine.live() == [] and [p.name for p in engine.state.vms.iterdir()] == [".engine.lock"]


def test_the_engine_counts_vms_destroyed_for_a_protocol_error(tmp_path: Path) -> None:
    engine = Engine(StateDir(tmp_path / "state"), hypervisor=HostileHypervisor(), pool_size=0)
    try:
        assert engine.protocol_errors == {"frame": 0, "decode": 0, "flood": 0}
        _restore_hostile(engine, _snapshot(tmp_path))
        _restore_hostile(engine, _snapshot(tmp_path))
        assert engine.protocol_errors == {"frame": 2, "decode": 0, "flood": 0}
    finally:
        engine.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mvc-perr-", dir="/tmp"))  # the API socket's path must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_protocol_errors_show_in_the_services_metrics(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hypervisor = HostileHypervisor()
    monkeypatch.setattr("runner.vm.engine.QemuHypervisor", lambda: hypervisor)
    config = config_from_mapping({"socket": str(short_dir / "api.sock"), "state_dir": str(short_dir / "state"),
                                  "listen": "127.0.0.1:0", "token": TOKEN, "shutdown_grace_seconds": 0})
    baked_template(short_dir / "state")  # the host starts only with the templates its config offers
    with ServiceHost(config, engine=EngineSettings(pool_size=0)) as host:
        assert host.engine is not None and host.api is not None
        _restore_hostile(host.engine, _snapshot(short_dir))
        address = host.api.tcp_address
        answer = httpx.get(f"http://{address[0]}:{address[1]}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, answer.text
    samples = {s.labels["kind"]: s.value for family in text_string_to_metric_families(answer.text)
               for s in family.samples if s.name == "microvm_check_guest_protocol_errors_total"}
    assert samples == {"frame": 1, "decode": 0, "flood": 0}
