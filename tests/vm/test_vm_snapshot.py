"""Templates made from running VMs (`Sandbox.snapshot`, `Engine.snapshot`), on real VMs.

Each test snapshots into a private template store that sees the shared `base` template through a
link, so nothing it makes is visible to other tests or left behind.
"""

from __future__ import annotations

import io
import tarfile
import threading

import pytest

from runner.sandbox import Sandbox
from runner.vm.errors import SandboxError
from runner.vm.templates import TemplateNotFound


def _tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.fixture
def private_templates(template_store, tmp_path):
    """A template store of this test's own, with the shared `base` linked in."""
    from runner.vm.templates import TemplateStore

    root = tmp_path / "templates"
    root.mkdir()
    (root / "base").symlink_to(template_store.root / "base")
    return TemplateStore(root)


@pytest.fixture
def private_engine(private_templates, tmp_path):
    from runner.vm.engine import Engine
    from runner.vm.statedir import StateDir
    from tests.vm.conftest import assert_no_leftovers

    engine = Engine(StateDir(tmp_path / "state"), templates=private_templates, pool_size=0)
    yield engine
    engine.close()
    assert_no_leftovers(engine.state)


def test_snapshot_of_a_dirty_vm_then_create_round_trip(private_engine, private_templates):
    """What the VM wrote (unsynced, a moment before) is in the template; the snapshotted sandbox runs
    on without its checkout; clones get the files, not the checkout, and their own random bytes."""
    engine = private_engine
    with Sandbox.create(engine=engine) as sbx:
        sbx.put_tar(io.BytesIO(_tar({"job.txt": b"the job's checkout\n"})))
        assert sbx.exec("cat /workspace/job.txt").stdout == b"the job's checkout\n"
        # 8 MiB written without a sync right before the snapshot: still dirty in the page cache
        made = sbx.exec("mkdir -p /opt/kept && head -c 8388608 /dev/urandom > /opt/kept/big && "
                        "echo installed > /opt/kept/marker && sha256sum /opt/kept/big", cwd="/")
        assert made.exit_code == 0, made.stderr
        with pytest.raises(SandboxError, match="is not a template name"):
            sbx.snapshot("../escape")
        digest = sbx.snapshot("with-deps")
        after = sbx.exec("cat /opt/kept/marker; ls /workspace", cwd="/")
        assert after.exit_code == 0 and after.stdout == b"installed\n", after
    template = private_templates.get("with-deps")
    assert template.digest == digest and template.derived and template.variants == ("nonet",)
    assert template.manifest["parent"]["name"] == "base"
    with pytest.raises(TemplateNotFound, match="snapshotted from a VM without a network card"):
        template.snapshot(network=True)
    randoms = []
    for _ in range(2):
        with Sandbox.create(template="with-deps", engine=engine) as clone:
            got = clone.exec("sha256sum /opt/kept/big; cat /opt/kept/marker; ls -A /workspace | wc -l; "
                             "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'", cwd="/")
            lines = got.stdout.decode().splitlines()
            assert lines[0] == made.stdout.decode().strip()
            assert lines[1:3] == ["installed", "0"]
            randoms.append(lines[3])
            clone.put_tar(io.BytesIO(_tar({"pr.txt": b"a later checkout\n"})))
            assert clone.exec("cat /workspace/pr.txt").stdout == b"a later checkout\n"
    assert len(randoms[0]) == 64 and randoms[0] != randoms[1]


def test_a_snapshot_is_refused_while_a_command_runs_or_a_daemon_holds_the_checkout(private_engine, private_templates):
    """The guest's own `quiesce` refuses, says why, and the sandbox runs on, its checkout still there;
    no template is made. (Before it was an operation, a failed umount in a shell script said only "exit 1".)"""
    with Sandbox.create(engine=private_engine) as sbx:
        sbx.put_tar(io.BytesIO(_tar({"job.txt": b"the job's checkout\n"})))
        running = threading.Thread(target=sbx.exec, args=("echo started > /tmp/started; exec sleep 600",), daemon=True)
        running.start()
        # A second command while the first runs: it returns once the first has started.
        waited = sbx.exec("for i in $(seq 600); do [ -e /tmp/started ] && exit 0; sleep 0.1; done; exit 1", cwd="/")
        assert waited.exit_code == 0
        with pytest.raises(SandboxError, match=r"1 command\(s\) still running: the checkout may be in use"):
            sbx.snapshot("refused")
        sbx.cancel()
        running.join(timeout=60)
        assert not running.is_alive()
        daemon = sbx.exec("sleep 600 > /dev/null 2>&1 < /dev/null & echo $! > /tmp/daemon")
        assert daemon.exit_code == 0, daemon.stderr
        with pytest.raises(SandboxError, match="a process left running \\(a daemon\\?\\) still uses the checkout"):
            sbx.snapshot("refused")
        assert sbx.exec("kill $(cat /tmp/daemon); cat /workspace/job.txt", cwd="/").stdout == b"the job's checkout\n"
    with pytest.raises(TemplateNotFound):
        private_templates.get("refused")
