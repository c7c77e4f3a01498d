"""Hostile images through `template build --image`: each is refused with one clear line naming the member and
the rule, nothing is written outside the build's own directories (a sentinel outside stays as it was), and the
build leaves nothing behind: no staging tree, no fetch directory, no template."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import require
from tests.vmimages.oci.images import Device, Dir, File, Symlink, write_layout
from vmimages.imageroot import FETCH_PARENT, FETCH_PREFIX

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "mvc-test-hostile"


def _escaping_layer() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("../../../escaped")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"bad"))
    return out.getvalue()


def _build(reference: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner.cli", "template", "build", TEMPLATE, "--image", reference],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.fixture
def builds() -> None:
    """Builds can run here, and no template of this test's name is left from elsewhere (a build that once
    succeeded, with a refusal mutated away): what the tests see after a refusal is the refusal's doing."""
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("skopeo") is not None, "skopeo is not installed (scripts/setup installs it)")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    store = TemplateStore(StateDir.default().templates)
    if TEMPLATE in [t.name for t in store.list()]:
        store.remove(TEMPLATE)


@pytest.fixture
def sentinel(builds: None, tmp_path: Path) -> Path:
    """A directory outside every build directory that a hostile image aims at."""
    path = tmp_path / "sentinel"
    path.mkdir()
    return path


@pytest.mark.parametrize("case", ["device", "escape", "through-a-link"])
def test_a_hostile_image_is_refused_and_leaves_nothing(case: str, sentinel: Path, tmp_path: Path):
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    layers = {
        "device": [[Dir("dev"), Device("dev/mem", "c", 1, 1)]],
        "escape": [_escaping_layer()],
        "through-a-link": [[Symlink("etc", str(sentinel))], [File("etc/passwd", "root::0:0::/:/bin/sh\n")]],
    }[case]
    layout = write_layout(tmp_path / "layout", layers)
    done = _build(layout.ref)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("microvm-check: template build failed: "), done.stderr[-2000:]
    assert {"device": "dev/mem", "escape": "escaped", "through-a-link": "etc/passwd"}[case] in last, last
    assert list(sentinel.iterdir()) == [] and not (tmp_path.parent / "escaped").exists()
    state = StateDir.default()
    assert not (state.cache / "staging" / TEMPLATE).exists()
    assert list(Path(FETCH_PARENT).glob(f"{FETCH_PREFIX}{TEMPLATE}-*")) == []  # this build's fetch directory
    assert TEMPLATE not in [t.name for t in TemplateStore(state.templates).list()]


def test_an_image_template_past_the_disk_budget_is_refused_before_its_snapshots(builds: None, tmp_path: Path):
    import json

    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore

    layout = write_layout(tmp_path / "layout", [[Dir("bin"), File("bin/busybox", Path("/bin/busybox").read_bytes(),
                                                                   mode=0o755)]])
    state = StateDir.default()
    config = tmp_path / "service.yml"
    config.write_text(json.dumps({"state_dir": str(state.root), "images": {"disk_budget": 1024 * 1024}}))
    done = subprocess.run([sys.executable, "-m", "runner.cli", "template", "build", TEMPLATE, "--image", layout.ref,
                           "--config", str(config)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "more than images.disk_budget (0.0 GiB): remove one with microvm-check template rm NAME" in done.stderr
    assert "bake the" not in done.stderr  # refused before any VM was booted for it
    assert not (state.cache / "staging" / TEMPLATE).exists()
    assert TEMPLATE not in [t.name for t in TemplateStore(state.templates).list()]
