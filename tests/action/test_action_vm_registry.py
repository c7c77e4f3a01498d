"""A `docker pull` goes through the job's egress policy: Debian's docker-registry serves an image in the
test's fake internet (registry.test:5000), and a job on the `docker` template pulls and runs it when its
policy has a `host:` rule for the registry, and cannot when its (narrowed) policy has none. Real VMs, real
namespaces; nothing leaves the namespaces the test made.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.action.action_harness import FORK_PR, Simulation, run_action
from tests.action.test_action_vm_docker import docker_template  # noqa: F401 (a fixture)
from tests.action.test_action_vm_e2e import _host
from tests.conftest import require
from tests.e2e.fake_internet import ALLOWED_HOST, fake_internet
from tests.net import net_fakes
from tests.reference import captured

pytestmark = pytest.mark.vm

REGISTRY_HOST = "203.0.113.50"
REGISTRY = "registry.test:5000"
net_fakes.ZONE["registry.test"] = REGISTRY_HOST  # the fake internet's DNS answers from ZONE
REPOSITORY = ("listendev", "lstn")  # FORK_PR's base repository: the store file below is its
STORE_POLICY = (f"version: 1\nallow:\n  - host: registry.test\n    ports: [5000]\n"
                f"  - cidr: {ALLOWED_HOST}/32\n    ports: [8000]\n")
# The engine trusts this plain-HTTP registry only after being told so (reloadable: SIGHUP).
TRUST_REGISTRY = (
    "python3 -c \"import json; p='/etc/docker/daemon.json'; d=json.load(open(p)); "
    f"d['insecure-registries']=['{REGISTRY}']; json.dump(d, open(p, 'w'))\" && kill -HUP $(cat /var/run/docker.pid) "
    f"&& for i in $(seq 1 100); do docker info 2>/dev/null | grep -q '{REGISTRY}' && break; sleep 0.2; done"
)


@pytest.fixture
def registry_service(docker_template: None, need_netns: None, tmp_path: Path) -> Iterator[object]:
    binary = shutil.which("docker-registry")
    require(binary is not None, "docker-registry is not installed (scripts/setup --test installs it)")
    assert binary is not None
    net_fakes.seed_registry(tmp_path / "registry", "db", "1")
    (tmp_path / "registry.yml").write_text(json.dumps({
        "version": 0.1, "log": {"level": "warn"}, "http": {"addr": f"{REGISTRY_HOST}:5000"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "registry")}}}))
    owner, repo = REPOSITORY
    (tmp_path / "store" / owner).mkdir(parents=True)
    (tmp_path / "store" / owner / f"{repo}.yml").write_text(STORE_POLICY)
    with fake_internet() as internet:
        net_fakes.ip("-n", internet.namespace, "addr", "add", f"{REGISTRY_HOST}/32", "dev", "lo")
        server = subprocess.Popen(["ip", "netns", "exec", internet.namespace, binary, "serve",
                                   str(tmp_path / "registry.yml")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            yield from _host({"network": internet.network, "policy_dir": str(tmp_path / "store"),
                              "templates": ["base", "docker"]}, internet)
        finally:
            server.terminate()
            server.wait(timeout=30)


@pytest.fixture
def sim(tmp_path: Path) -> Simulation:
    (tmp_path / "workspace").mkdir()
    (tmp_path / "runner-temp").mkdir()
    return Simulation(tmp_path / "workspace", tmp_path / "runner-temp", captured(FORK_PR))


def test_a_pull_is_admitted_by_a_host_rule_and_refused_without_one(registry_service, sim) -> None:
    socket = registry_service.config.socket
    pull = f"{TRUST_REGISTRY} && docker pull -q {REGISTRY}/db:1 && docker run --rm {REGISTRY}/db:1 echo pulled-and-ran"
    admitted = run_action(sim, {"template": "docker", "socket": socket, "timeout-minutes": "10", "run": pull})
    assert admitted.returncode == 0, admitted.log
    assert "pulled-and-ran" in admitted.log.replace("echo pulled-and-ran", ""), admitted.log
    # The same job narrowed to the fake web host alone: it keeps its network card, the registry is refused.
    narrowed = f"version: 1\nallow:\n  - cidr: {ALLOWED_HOST}/32\n    ports: [8000]\n"
    refused = run_action(sim, {"template": "docker", "socket": socket, "timeout-minutes": "10", "run": pull,
                               "policy": narrowed})
    assert refused.returncode != 0, refused.log
    assert "pulled-and-ran" not in refused.log.replace("echo pulled-and-ran", ""), refused.log
    assert "registry.test" in refused.summary, refused.summary  # the blocked egress names what was refused
