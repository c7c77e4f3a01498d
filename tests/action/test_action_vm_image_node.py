"""A Node project's checks through the action, on an image template with Node and no Python: the image is
made here from this machine's Node.js (its binary and the libraries it links) on a static busybox, as an
OCI layout, and `template build --image oci:...` makes the template. The job reports the image's
os-release, WORKDIR and env, finds no python3, and `node --test` passes with its JUnit report as an
artifact the action reads. Real VMs; no network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.attest import dsse
from runner.attest.statement import Statement
from runner.jobapi.client import JobClient
from runner.jobapi.contract import ImageUsed, TemplateRef
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateStore
from tests.action.action_harness import FORK_PR, Simulation, run_action
from tests.action.test_action_vm_e2e import _host
from tests.conftest import require
from tests.reference import captured
from tests.vmimages.oci.images import Dir, File, Symlink, write_layout

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "mvc-test-node"
APPLETS = ("sh", "cat", "echo", "pwd", "ls", "true", "which")
TEST_JS = """const test = require('node:test');
const assert = require('node:assert');
test('adds', () => assert.strictEqual(1 + 1, 2));
test('reads the image env', () => assert.strictEqual(process.env.NODE_ENV, 'test'));
"""


def _node_layer(node: Path) -> list[object]:
    """The node binary and every library `ldd` says it loads, at the paths it loads them from."""
    entries: list[object] = [Dir("usr"), Dir("usr/local"), Dir("usr/local/bin"),
                             File("usr/local/bin/node", node.read_bytes(), mode=0o755)]
    libraries = re.findall(r"(/\S+) \(0x", subprocess.run(["ldd", str(node)], capture_output=True, text=True,
                                                          check=True).stdout)
    made = {"usr", "usr/local", "usr/local/bin"}
    for library in libraries:
        parts = library.strip("/").split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            if directory not in made:
                made.add(directory)
                entries.append(Dir(directory))
        entries.append(File("/".join(parts), Path(library).read_bytes(), mode=0o755))
    return entries


@pytest.fixture(scope="module")
def node_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    require(os.geteuid() == 0, "not running as root")
    node = shutil.which("node")
    for tool, found in (("qemu-system-x86_64", shutil.which("qemu-system-x86_64")), ("skopeo", shutil.which("skopeo")),
                        ("node", node)):
        require(found is not None, f"{tool} is not installed")
    require(Path("/bin/busybox").exists(), "busybox-static is not installed")
    assert node is not None
    tmp = tmp_path_factory.mktemp("node-image")
    busybox = [Dir("bin"), File("bin/busybox", Path("/bin/busybox").read_bytes(), mode=0o755),
               *(Symlink(f"bin/{name}", "busybox") for name in APPLETS), Dir("etc"),
               File("etc/os-release", 'ID=mvcnode\nPRETTY_NAME="microvm-check test node"\n'),
               File("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), File("etc/group", "root:x:0:\n"),
               Dir("root", mode=0o700), Dir("tmp", mode=0o1777), Dir("app", mode=0o755)]
    layout = write_layout(tmp / "layout", [busybox, _node_layer(Path(node).resolve())],
                          env=("PATH=/usr/local/bin:/bin", "NODE_ENV=test"), workdir="/app")
    built = subprocess.run([sys.executable, "-m", "runner.cli", "template", "build", TEMPLATE, "--image", layout.ref],
                           capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert built.returncode == 0, built.stderr[-3000:]
    yield
    subprocess.run([sys.executable, "-m", "runner.cli", "template", "rm", TEMPLATE, "--yes"], check=True,
                   capture_output=True, cwd=ROOT)


REPOSITORY = ("listendev", "lstn")  # FORK_PR's base repository


@pytest.fixture
def node_service(node_template: None, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[object]:
    """A service offering only `base` to every repository, whose store file for the pull request's repository
    is `request.param` (the image template is that repository's own to use, or not)."""
    owner, repo = REPOSITORY
    (tmp_path / "store" / owner).mkdir(parents=True)
    (tmp_path / "store" / owner / f"{repo}.yml").write_text(request.param)
    yield from _host({"templates": ["base"], "policy_dir": str(tmp_path / "store")})


@pytest.fixture
def sim(tmp_path: Path) -> Simulation:
    (tmp_path / "workspace" / "test").mkdir(parents=True)
    (tmp_path / "workspace" / "package.json").write_text('{"name": "sample", "version": "1.0.0"}\n')
    (tmp_path / "workspace" / "test" / "math.test.js").write_text(TEST_JS)
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    return Simulation(tmp_path / "workspace", temp, captured(FORK_PR))


@pytest.mark.parametrize("node_service", [f"version: 1\ntemplates: [{TEMPLATE}]\n"], indirect=True)
def test_node_test_passes_in_the_image_with_its_junit_report(node_service, sim: Simulation) -> None:
    report = "--test-reporter=spec --test-reporter-destination=stdout --test-reporter=junit " \
             "--test-reporter-destination=report.xml"
    result = run_action(sim, {
        "template": TEMPLATE, "socket": str(node_service.config.socket), "timeout-minutes": "10",
        "artifacts": "report.xml",
        "run": "cat /etc/os-release; echo \"pwd=$(pwd) env=$NODE_ENV\"; "
               "if which python3; then echo has-python; else echo no-python; fi; "
               f"node --version && node --test {report}"})
    assert result.returncode == 0, result.log
    assert "ID=mvcnode" in result.log and "pwd=/app env=test" in result.log, result.log
    lines = result.log.splitlines()
    assert "no-python" in lines and "has-python" not in lines, result.log
    assert (result.outputs["exit-code"], result.outputs["junit-passed"], result.outputs["junit-failed"]) == \
        ("0", "2", "0"), result.outputs
    assert (sim.workspace / "artifacts" / "report.xml").exists()
    # what the VM restored from: one value in the job's record and its signed record, the image's pinned too
    envelope = dsse.bundle(Path(result.outputs["attestation"]).read_bytes())[0]
    predicate = Statement.parse(envelope.verify(node_service.service.attestor.key.public)).predicate
    restored = JobClient(socket=str(node_service.config.socket)).get(predicate.job["id"]).restored_from
    built = TemplateStore(StateDir.default().templates).get(TEMPLATE)
    assert restored is not None and restored.template == TemplateRef(TEMPLATE, built.digest), restored
    assert restored.image == ImageUsed(built.manifest["image"]["pinned"], built.manifest["image"]["manifest_digest"])
    assert restored.image.ref.startswith("oci:") and restored.base is None
    assert (predicate.template, predicate.image) == ({"name": TEMPLATE, "digest": built.digest},
                                                     {"ref": restored.image.ref, "digest": restored.image.digest})


@pytest.mark.parametrize("node_service", ["version: 1\n"], indirect=True)
def test_a_template_the_repository_is_not_offered_is_refused_naming_its_store_file(node_service, sim) -> None:
    result = run_action(sim, {"template": TEMPLATE, "socket": str(node_service.config.socket), "run": "true"})
    assert result.returncode != 0
    assert f"template: '{TEMPLATE}' is not offered here to listendev/lstn" in result.log, result.log
    assert f"(<owner>/<repo>.yml, templates: [{TEMPLATE}])" in result.log, result.log
