"""What the service's tests submit and expect, for tests of its own logic (queueing, cancel, limits,
hostile tars) that must run everywhere: specs, checkouts, tars, a baked template's record, and the egress
the stand-in guests report. The stand-in VMs are the port's own fake (runner/sandbox/fake.py); real-VM
tests live in test_vm_e2e.py.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

from policy.suggest import AuditRecord
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.job import AdmittedSpec
from runner.service.jobs.spec import parse_submission
from runner.vm import guestwire

SHA = "0123456789abcdef0123456789abcdef01234567"


# The egress every stand-in guest of the tests' `engine` fixture (tests/fakehost.py) was refused:
# what the real engine returns, runner.net's audit records.
BLOCKED = (AuditRecord(dest="192.0.2.7", port=443, proto="tcp", name="blocked.example", count=2),
           AuditRecord(dest="198.51.100.1", port=None, proto="icmp", name=None, count=1))


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
