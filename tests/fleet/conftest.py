"""The fleet rig: a runner user and group, the stand-in runner installed with `runner install --from`,
a fake GitHub (responses + a queue directory), and the real service (ServiceHost) built from a config
file with a `runners:` section, on real VMs unless a test needs none.

Everything lives in one short directory under /run, not /tmp: each runner gets a /tmp of its own
(runner/fleet/walls.py), in which the rig would not exist (socket paths stay short; the runner user must
reach the socket, so it is 0755, unlike pytest's 0700 tmp_path). Teardown closes the service, then
checks that nothing of the runner user is left: no process, no file in the rig or a temporary directory.
"""

from __future__ import annotations

import hashlib
import io
import os
import pwd
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import responses
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.conftest import require
from tests.fleet.fleet_fakes import FakeGitHub
from tests.fleet.waiting import SERVING
from tests.procs import runs

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin_runner.py"
PYTHON = ROOT / ".venv" / "bin" / "python"
LABELS = ["microvm-check"]
VERSION = "2.336.0"
RUN_SH = f'#!/bin/sh\nexec {PYTHON} -I "$(dirname "$0")/bin/standin_runner.py" "$@"\n'


@dataclass(frozen=True)
class Account:
    user: str
    group: str
    uid: int


@pytest.fixture
def account(need_root: None) -> Iterator[Account]:
    with runner_account() as made:
        yield made


@contextmanager
def runner_account() -> Iterator[Account]:
    """A runner user of the test's own, in a group of its own that is also the job API socket's group."""
    tag = secrets.token_hex(3)
    user, group = f"mvcfr{tag}", f"mvcfg{tag}"
    subprocess.run(["groupadd", "--system", group], check=True)
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--gid", group,
                    "--groups", group, user], check=True)
    uid = pwd.getpwnam(user).pw_uid
    try:
        yield Account(user, group, uid)
    finally:
        left = [pid for pid in subprocess.run(["pgrep", "-u", str(uid)], capture_output=True, text=True).stdout.split()
                if runs(int(pid))]
        subprocess.run(["pkill", "-KILL", "-u", str(uid)], check=False)
        subprocess.run(["userdel", user], check=False)
        subprocess.run(["groupdel", group], check=False)
        assert left == [], f"processes of the runner user left running: {left}"


@pytest.fixture
def host_mqueue(need_root: None) -> Iterator[Path]:
    """The host's /dev/mqueue, as systemd mounts it (a POSIX message queue filesystem, mode 1777):
    mounted for the test when this host has none, unmounted after."""
    from runner.fleet.lastwalls import mqueue_mounts

    where = Path("/dev/mqueue")
    if str(where) in mqueue_mounts(Path("/proc/self/mountinfo").read_text()):
        yield where
        return
    made = not where.exists()
    where.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "mqueue", "-o", "nosuid,nodev,noexec", "mqueue", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
        if made:
            where.rmdir()


def runner_uids_seen(root: Path) -> set[int]:
    """The runners' own uids (runner.uidrange.RUNNER_UIDS) of processes still running in the rig, or
    owning a file in it."""
    from runner import uidrange

    seen = set()
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            try:
                seen.add(os.lstat(os.path.join(directory, name)).st_uid)
            except FileNotFoundError:
                pass
    return {uid for uid in seen if uid in uidrange.RUNNER_UIDS}


def standin_tarball(directory: Path) -> tuple[Path, str]:
    """actions-runner-linux-x64-V.tar.gz's layout, with the stand-in as the runner: run.sh and bin/."""
    path = directory / f"actions-runner-linux-x64-{VERSION}.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        for name, data, mode in (("./run.sh", RUN_SH.encode(), 0o755),
                                 ("./bin/standin_runner.py", STANDIN.read_bytes(), 0o644)):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def user_files(uid: int, places: list[Path]) -> list[str]:
    found = []
    for place in places:
        for directory, dirs, files in os.walk(place):
            for name in [*dirs, *files]:
                path = os.path.join(directory, name)
                try:
                    if os.lstat(path).st_uid == uid:
                        found.append(path)
                except FileNotFoundError:
                    pass
    return found


@dataclass
class Rig:
    root: Path
    config_path: Path
    github: FakeGitHub
    account: Account
    mock: responses.RequestsMock
    host: Any = None

    @property
    def runners_dir(self) -> Path:
        return self.root / "runners"

    @property
    def fleet(self) -> Any:
        return self.host.fleet

    def runner_dirs(self) -> list[str]:
        return sorted(p.name for p in self.runners_dir.iterdir() if p.name != "_hooks")

    def action_step(self, run: str) -> dict[str, Any]:
        return {"uses": "microvm-check", "with": {"run": run, "socket": str(self.root / "api.sock"),
                                                  "timeout-minutes": "5"}}

    def enqueue(self, job_id: int, steps: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return self.github.enqueue(job_id, steps, LABELS, python=str(PYTHON), action=str(ROOT / "action.yml"),
                                   **fields)


def _app_settings(root: Path) -> Path:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = root / "app.pem"
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    pem.chmod(0o600)
    path = root / "github.yml"
    path.write_text(yaml.safe_dump({"client_id": "Iv1.8a61f9b3a7aba766", "private_key_path": str(pem),
                                    "installation_id": 3456996, "org": "octo-org"}))
    return path


def write_config(root: Path, account: Account, runners: dict[str, Any], **service: Any) -> Path:
    """The service config file: the job API socket for the runner user's group, the webhook, `runners:`."""
    settings = {"socket": str(root / "api.sock"), "socket_group": account.group, "state_dir": str(root / "state"),
                "max_concurrent_jobs": 2, "shutdown_grace_seconds": 30,
                "webhook": {"listen": "127.0.0.1:0", "secret_path": str(root / "webhook-secret"),
                            "labels": list(LABELS)},
                "runners": {"org": "octo-org", "github_config": str(_app_settings(root)), "labels": list(LABELS),
                            "runner_user": account.user, "install_dir": str(root / "release"),
                            "runners_dir": str(root / "runners"), "name_prefix": "mvc-test", **runners}, **service}
    path = root / "service.yml"
    path.write_text(yaml.safe_dump(settings))
    return path


@pytest.fixture
def rig_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="mvc-fleet-", dir="/run"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_rig(account: Account, rig_root: Path) -> Iterator[Any]:
    """A factory: `with make_rig(max_runners=2) as rig:` serves until the block ends; `start(rig)` again
    builds a new service on the same state (a restart)."""
    from runner.cli import main

    root = rig_root
    secret = secrets.token_hex(16).encode()
    (root / "webhook-secret").write_bytes(secret)
    tarball, digest = standin_tarball(root)
    mock = responses.RequestsMock(assert_all_requests_are_fired=False)
    github = FakeGitHub("octo-org", root / "queue", secret)
    github.install(mock)
    mock.start()

    @contextmanager
    def make(vms: bool = True, **runners: Any) -> Iterator[Rig]:
        path = write_config(root, account, runners)
        if not (root / "release" / "current").exists():
            assert main(["runner", "install", "--version", VERSION, "--from", str(tarball), "--sha256", digest,
                         "--service-config", str(path)]) == 0
        rig = Rig(root, path, github, account, mock)
        with serve(rig, vms):
            yield rig

    try:
        yield make
    finally:
        mock.stop()
        mock.reset()
    left = user_files(account.uid, [root, Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")])
    assert left == [], f"files of the runner user left behind: {left[:10]}"
    leased = [path for uid in runner_uids_seen(root) for path in user_files(uid, [root])]
    assert leased == [], f"files of a runner's own uid left behind: {leased[:10]}"


@contextmanager
def serve(rig: Rig, vms: bool = True) -> Iterator[Rig]:
    """The real service from the rig's config file, as `serve` builds it (real VMs unless `vms` is False)."""
    from runner.service.config.reading import load_config
    from runner.service.host.assembly import EngineSettings, ServiceHost

    config = load_config(rig.config_path)
    if vms:
        require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
        from runner.vm.statedir import StateDir
        from runner.vm.templates import TemplateNotFound, TemplateStore

        templates = TemplateStore(StateDir.default().templates)
        try:
            templates.get("base")
        except TemplateNotFound as exc:
            require(False, str(exc))
        host = ServiceHost(config, engine=EngineSettings(templates=templates, pool_size=0), origin=str(rig.config_path))
    else:
        host = ServiceHost(config, sandboxes=_no_vms, origin=str(rig.config_path))
    with host:
        rig.host = host
        assert host.webhook is not None
        rig.github.webhook_port = host.webhook.port
        SERVING.append(host)
        try:
            yield rig
        finally:
            SERVING.remove(host)
        if host.engine is not None:
            host.service.drain()
            # A VM destroyed on another thread (a pre-warmed one, at drain) leaves the engine's list just after.
            deadline = time.monotonic() + 30
            while any(vm.destroyed for vm in host.engine.live()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert host.engine.live() == [], "a job's VM outlived the service"


def _no_vms(request: Any) -> Any:
    raise AssertionError("this test runs no job: no VM may be created")

