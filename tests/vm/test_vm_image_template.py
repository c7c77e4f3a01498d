"""An image template, end to end on real VMs: a multi-layer image with no Python (Debian's static busybox,
whiteouts, an opaque directory, a set-uid program, ENV, WORKDIR and USER) is pushed to Debian's
docker-registry on loopback, `template build NAME --image docker://...` fetches, verifies and unpacks it into
a template, and jobs through `microvm-check run` see the image and nothing of the VM's own root filesystem.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.conftest import require
from tests.net import net_fakes
from tests.vmimages.oci.images import Dir, File, Opaque, Symlink, Whiteout, push, registry, write_layout

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "mvc-test-busybox"
APPLETS = ("sh", "cat", "id", "pwd", "ls", "echo", "head", "od", "date", "which", "printenv", "true", "tr", "wc",
           "mkdir")
OS_RELEASE = 'ID=mvcbusy\nNAME="microvm-check test busybox"\n'
SHOW_EUID = """#include <stdio.h>
#include <unistd.h>
int main(void) { printf("euid=%d uid=%d\\n", (int)geteuid(), (int)getuid()); return 0; }
"""


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _show_euid(tmp: Path) -> bytes:
    source = tmp / "showeuid.c"
    source.write_text(SHOW_EUID)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(tmp / "showeuid"), str(source)], check=True)
    return (tmp / "showeuid").read_bytes()


def _layers(tmp: Path) -> list[list[object]]:
    """Three layers: busybox and the files a job reports; then whiteouts, an opaque directory and a set-uid
    program; then a file in the working directory."""
    base: list[object] = [Dir("bin"), File("bin/busybox", Path("/bin/busybox").read_bytes(), mode=0o755)]
    base += [Symlink(f"bin/{name}", "busybox") for name in APPLETS]
    base += [Dir("etc"), File("etc/os-release", OS_RELEASE),
             File("etc/passwd", "root:x:0:0:root:/root:/bin/sh\napp:x:1234:1234:app:/home/app:/bin/sh\n"),
             File("etc/group", "root:x:0:\napp:x:1234:\n"), Dir("root", mode=0o700), Dir("home"),
             Dir("home/app", uid=1234, gid=1234), Dir("app", mode=0o777), Dir("opt"), Dir("opt/old"),
             File("opt/old/gone.txt", "lower\n"), File("opt/old/kept.txt", "lower\n"), Dir("opt/keep"),
             File("opt/keep/hidden.txt", "lower\n"), Dir("tmp", mode=0o1777)]
    second: list[object] = [Whiteout("opt/old/gone.txt"), Opaque("opt/keep"), File("opt/keep/new.txt", "upper\n"),
                            Dir("usr"), Dir("usr/local"), Dir("usr/local/bin"),
                            File("usr/local/bin/showeuid", _show_euid(tmp), mode=0o4755)]
    return [base, second, [File("app/from-image.txt", "in the image's WORKDIR\n")]]


@pytest.fixture(scope="module")
def image_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require(os.geteuid() == 0, "not running as root")
    for tool in ("qemu-system-x86_64", "skopeo", "docker-registry", "gcc"):
        require(shutil.which(tool) is not None, f"{tool} is not installed (scripts/setup --test installs it)")
    require(Path("/bin/busybox").exists(), "busybox-static is not installed")
    from runner.vm.statedir import StateDir

    tmp = tmp_path_factory.mktemp("image")
    layout = write_layout(tmp / "layout", _layers(tmp), env=("PATH=/usr/local/bin:/bin", "GREETING=hello-from-image"),
                          workdir="/app", user="app")
    with registry(tmp / "registry") as port:
        reference = push(layout, port, "test/busybox", "1")
        (tmp / "registries.conf").write_text(f'[[registry]]\nlocation = "127.0.0.1:{port}"\ninsecure = true\n')
        (tmp / "service.yml").write_text(json.dumps({
            "state_dir": str(StateDir.default().root), "templates": [TEMPLATE],
            "images": {"registries_conf": str(tmp / "registries.conf")}}))
        built = _cli("template", "build", TEMPLATE, "--image", reference, "--config", str(tmp / "service.yml"))
    assert built.returncode == 0, built.stderr[-3000:]
    assert f"template {TEMPLATE} " in built.stderr and "image unpacked" in built.stderr
    yield reference
    removed = _cli("template", "rm", TEMPLATE, "--yes")  # a test's template takes no disk after it
    assert removed.returncode == 0, removed.stderr


def _run(tmp: Path, script: str) -> subprocess.CompletedProcess[str]:
    checkout = tmp / "checkout"
    checkout.mkdir(parents=True, exist_ok=True)
    (checkout / "from-checkout.txt").write_text("the job's checkout\n")
    return _cli("run", "--template", TEMPLATE, "--socket", str(tmp / "no-service.sock"), "--dir", str(checkout),
                "--timeout", "120", "--", "sh", "-c", script, timeout=600)


def test_a_job_runs_in_the_image_with_its_env_workdir_and_user(image_template: str, tmp_path: Path):
    script = ("cat /etc/os-release; echo \"greeting=$GREETING\"; echo \"pwd=$(pwd)\"; echo \"id=$(id -u):$(id -g)\"; "
              "echo \"path=$PATH\"; ls; if command -v python3; then echo has-python; else echo no-python; fi; "
              "showeuid; ls /opt/old /opt/keep; cat /etc/debian_version 2>&1 || true")
    done = _run(tmp_path, script)
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ID=mvcbusy" in out and "greeting=hello-from-image" in out
    assert "pwd=/app" in out and "id=1234:1234" in out
    assert "path=/usr/local/bin:/bin" in out
    # the checkout is where the job's commands run, the image's WORKDIR, whose own files stay visible below it
    assert "from-checkout.txt" in out and "from-image.txt" in out
    assert "no-python" in out and "has-python" not in out
    assert "euid=0 uid=1234" in out  # the set-uid bit of the image works in the guest
    listing = out[out.index("euid=0"):]
    assert "kept.txt" in listing and "gone.txt" not in listing  # the whiteout
    assert "new.txt" in listing and "hidden.txt" not in listing  # the opaque directory
    assert "No such file" in listing  # the VM's own Debian root is not the job's


def test_a_command_the_image_lacks_fails_clearly(image_template: str, tmp_path: Path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    done = _cli("run", "--template", TEMPLATE, "--socket", str(tmp_path / "no.sock"), "--dir", str(checkout),
                "--timeout", "60", "--", "python3", "-c", "print(1)", timeout=600)
    assert done.returncode != 0
    assert "python3" in (done.stdout + done.stderr)


def test_two_restores_read_different_random_numbers_and_the_hosts_clock(image_template: str, tmp_path: Path):
    seen = []
    for n in range(2):
        before = time.time()
        done = _run(tmp_path / str(n), "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; date +%s")
        after = time.time()
        assert done.returncode == 0, done.stderr[-2000:]
        random_hex, clock = done.stdout.split()[-2:]
        assert before - 1 <= int(clock) <= after + 1
        seen.append(random_hex)
    assert seen[0] != seen[1]


def test_template_list_says_where_the_template_came_from(image_template: str):
    listing = _cli("template", "list")
    line = next(line for line in listing.stdout.splitlines() if line.startswith(TEMPLATE + " "))
    assert f"image {image_template} (sha256:" in line


def test_the_jobs_ca_goes_into_the_images_trust_store_as_root(image_template: str, need_netns: None, make_engine,
                                                              tmp_path: Path):
    """A policy whose HTTPS the host reads (a methods: rule) puts the job's CA where the image's programs look,
    though this image has no such directories and runs as its USER (1234)."""
    from policy import load_policy
    from runner.sandbox import Sandbox
    from runner.sandbox.sandbox import GUEST_CA_BUNDLE, JOB_CA_FILE

    prefix = "v" + secrets.token_hex(3)
    policy = load_policy("version: 1\nallow:\n  - host: tls.test\n    ports: [8443]\n    methods: [GET]\n", "policy")
    with ExitStack() as cleanup:
        _internet, pool = net_fakes.tls_internet(prefix, tmp_path, cleanup)
        engine = make_engine(net=pool)
        cleanup.callback(engine.close)
        with Sandbox.create(template=TEMPLATE, engine=engine, policy=policy) as sbx:
            env = sbx.install_job_ca()
            ca = sbx.files.read(JOB_CA_FILE)
            assert ca.startswith(b"-----BEGIN CERTIFICATE-----")
            assert ca in sbx.files.read(GUEST_CA_BUNDLE)
            assert env["SSL_CERT_FILE"] == GUEST_CA_BUNDLE and env["NODE_EXTRA_CA_CERTS"] == JOB_CA_FILE
            assert sbx.exec(["id", "-u"], cwd="/").stdout.strip() == b"1234"  # the job's own commands: USER
    assert net_fakes.leftovers(prefix) == [], "namespaces or links of the test left behind"


def test_doctor_checks_an_offered_image_template_and_says_its_image(image_template: str, tmp_path: Path):
    from runner.vm.statedir import StateDir

    config = tmp_path / "service.yml"
    config.write_text(json.dumps({"state_dir": str(StateDir.default().root), "templates": [TEMPLATE],
                                  "socket": str(tmp_path / "api.sock")}))
    done = _cli("doctor", "--config", str(config), timeout=300)
    line = next(line for line in done.stdout.splitlines() if f"template '{TEMPLATE}'" in line)
    assert line.startswith("ok ") and f"image {image_template} sha256:" in line, done.stdout
    assert "ok  skopeo is installed" in done.stdout
