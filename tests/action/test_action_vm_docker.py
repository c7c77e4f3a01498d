"""Docker inside the job's VM (the `docker` template), end to end on real VMs with no network at all:
`docker build` of a local context and `docker run` of the result, through the action and through
`microvm-check run --template docker`; what a job leaves of the engine (a running container, an image)
is gone in the next job. Needs root, QEMU and the built `docker` template: skipped locally, failing
under CI=true (scripts/setup --test builds it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.action.action_harness import FORK_PR, Simulation, run_action
from tests.action.test_action_vm_e2e import _host
from tests.conftest import require
from tests.reference import captured

pytestmark = pytest.mark.vm

# An image of nothing but a static busybox: builds with no registry, no base image, no network.
DOCKERFILE = 'FROM scratch\nCOPY busybox /bin/busybox\nENTRYPOINT ["/bin/busybox"]\n'
BUILD_AND_RUN = "docker build -q -t t . && docker run --rm t echo ok"


@pytest.fixture(scope="module")
def docker_template() -> None:
    require(os.geteuid() == 0, "not running as root")
    require(shutil.which("qemu-system-x86_64") is not None, "QEMU is not installed")
    require(Path("/bin/busybox").exists(), "busybox-static is not installed")
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateNotFound, TemplateStore

    try:
        TemplateStore(StateDir.default().templates).get("docker")
    except TemplateNotFound as exc:
        require(False, str(exc))


def docker_context(workspace: Path) -> None:
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / "Dockerfile").write_text(DOCKERFILE)
    shutil.copy2("/bin/busybox", workspace / "busybox")


@pytest.fixture(scope="module")
def docker_service(docker_template: None) -> Iterator[object]:
    """One service, so one restore of its docker spare VM, for both action tests: each job still gets a VM of
    its own (what the next-job test checks); at the end no job's VM outlives the service (`_host`)."""
    yield from _host({"templates": ["docker", "base"]})  # the default first: the spare VM is a docker one


@pytest.fixture
def sim(tmp_path: Path) -> Simulation:
    docker_context(tmp_path / "workspace")
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    return Simulation(tmp_path / "workspace", temp, captured(FORK_PR))


def test_docker_build_and_run_through_local_run(docker_template: None, tmp_path: Path, monkeypatch,
                                                capfd) -> None:
    from runner.cli import main

    co = tmp_path / "co"
    docker_context(co)
    monkeypatch.chdir(tmp_path)
    status = main(["run", "--socket", str(tmp_path / "none.sock"), "--dir", str(co), "--template", "docker",
                   "--timeout", "600", "--", BUILD_AND_RUN])
    out = capfd.readouterr().out
    assert status == 0, out
    assert "ok" in out.splitlines(), out


# A database-like service: busybox's httpd serving its "rows" on port 5432, logging each request.
SERVICE_DOCKERFILE = ('FROM scratch\nCOPY busybox /bin/busybox\nCOPY www /www\n'
                      'ENTRYPOINT ["/bin/busybox", "httpd", "-f", "-v", "-p", "5432", "-h", "/www"]\n')
READY = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 5432), 1)\""
QUERY = "python3 -c \"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:5432/rows').read().decode())\""


def test_build_run_and_a_service_through_the_action_then_the_next_job_finds_nothing(docker_service, sim) -> None:
    """One job (one VM) starts a database-like service built from its checkout, reaches it on its port once
    it is ready, builds an image, runs it, and leaves a container running and the image behind; the next
    job (its own VM from the same snapshot) finds neither: the engine's state lived on the job's overlay."""
    service_dir = sim.workspace / "db"
    (service_dir / "www").mkdir(parents=True)
    (service_dir / "www" / "rows").write_text("id=1 name=alice\n")
    (service_dir / "Dockerfile").write_text(SERVICE_DOCKERFILE)
    shutil.copy2("/bin/busybox", service_dir / "busybox")
    services = (f"- name: db\n  build: db\n  ports: ['5432']\n  env: {{POSTGRES_PASSWORD: example}}\n"
                f"  ready: {json.dumps(READY)}\n")
    socket = docker_service.config.socket
    first = run_action(sim, {"template": "docker", "socket": socket, "timeout-minutes": "10", "services": services,
                             "run": f"{QUERY} && echo env=$(docker inspect -f '{{{{range .Config.Env}}}}{{{{.}}}} "
                                    f"{{{{end}}}}' mvc-service-db) && {BUILD_AND_RUN} "
                                    "&& docker run -d --name left t sleep 1000 >/dev/null"})
    assert first.returncode == 0, first.log
    lines = first.log.splitlines()
    assert "ok" in lines, first.log
    assert "id=1 name=alice" in lines and "env=POSTGRES_PASSWORD=example" in first.log, first.log
    assert "microvm-check services: db is ready" in lines, first.log
    assert any(line.startswith("[db] ") and "response:200" in line for line in lines), first.log
    second = run_action(sim, {"template": "docker", "socket": socket, "timeout-minutes": "10",
                              "run": "echo containers=$(docker ps -aq | wc -l) images=$(docker images -aq | wc -l)"})
    assert second.returncode == 0, second.log
    assert "containers=0 images=0" in second.log, second.log


def test_a_service_that_never_gets_ready_fails_the_job_saying_so(docker_service, sim) -> None:
    """The checkout's own image is busybox with no command: it prints its help and exits at once."""
    services = ("- name: db\n  build: .\n  ready: 'test -e /nonexistent'\n  ready-timeout-seconds: 3\n")
    result = run_action(sim, {"template": "docker", "socket": docker_service.config.socket, "timeout-minutes": "10",
                              "services": services, "run": "echo ran-$((40 + 2))"})
    assert result.returncode == 125, result.log
    assert ("db never got ready: its ready command 'test -e /nonexistent' did not succeed within 3 s; "
            "the container is exited") in result.log, result.log
    assert "ran-42" not in result.log  # the command never started
