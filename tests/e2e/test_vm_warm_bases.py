"""Warm bases per repository (runner.service.jobs.bases) on real VMs, against a fake default branch.

GitHub is `responses` (tests/service/warm_fakes.py): the repository from a real delivery, the contents
API for the policy file and the input listings, and the tarball endpoint's redirect to a download.
The setup installs a wheel built there, from the checkout.
"""

from __future__ import annotations

import io
import tarfile

import pytest
import responses

from policy import PolicyStore
from runner.github.client import GitHubClient
from runner.github.policy_source import PolicySource
from runner.sandbox import EngineSandboxes, Sandbox
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.bases import BaseSettings, RepositoryBases, base_name, branch_warm
from tests.service.warm_fakes import FIRST_COMMIT, POLICY, REPO, DefaultBranch
from tests.vm.conftest import template_store  # noqa: F401 - the built template fixture, as in tests/vm

pytestmark = pytest.mark.vm


@pytest.fixture
def private_engine(template_store, tmp_path):
    from runner.vm.engine import Engine
    from runner.vm.statedir import StateDir
    from runner.vm.templates import TemplateStore
    from tests.vm.conftest import assert_no_leftovers

    root = tmp_path / "templates"
    root.mkdir()
    (root / "base").symlink_to(template_store.root / "base")
    engine = Engine(StateDir(tmp_path / "state"), templates=TemplateStore(root), pool_size=0)
    yield engine
    engine.close()
    assert_no_leftovers(engine.state)


def _checkout(files: dict[str, bytes]) -> io.BytesIO:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out.seek(0)
    return out


JOB = ("PYTHONPATH=/opt/warm python3 -c 'import tinypkg; print(tinypkg.VERSION)'; cat /opt/setup-runs; "
       "cat /workspace/requirements.txt; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")


@responses.activate
def test_a_base_from_the_default_branch_serves_jobs_and_is_rebuilt_when_an_input_changes(private_engine):
    engine = private_engine
    branch = DefaultBranch({".github/microvm-check.yml": POLICY, "requirements.txt": "tinypkg==1.0\n"})
    branch.register()
    github = PolicySource(GitHubClient(lambda: "ghs_installation_token", sleep=lambda _: None))
    bases = RepositoryBases(EngineSandboxes(engine), branch_warm(PolicyStore(None), github), github,
                            BaseSettings.from_config(ServiceConfig()))
    name = base_name("base", REPO, network=False)

    # no base yet: the job would take the bare template, and the base is built beside it
    assert bases.template_for(REPO, network=False) == "base"
    bases.wait(REPO, timeout=900)
    first = engine.templates.get(name)
    assert bases.template_for(REPO, network=False) == name
    assert len(branch.tarball_refs) == 1  # current: the listings said so, nothing was downloaded again
    assert first.manifest["base"]["commit"] == FIRST_COMMIT

    # jobs restore from it: the package is there, setup ran once (in the build), a pull request that
    # changes requirements.txt still runs on the default branch's base; each job has its own entropy
    randoms = []
    for requirements in (b"tinypkg==1.0\n", b"tinypkg==2.0\nrequests\n"):
        with Sandbox.create(template=bases.template_for(REPO, network=False), engine=engine) as job:
            job.put_tar(_checkout({"requirements.txt": requirements}))
            out = job.exec(JOB).stdout.decode().splitlines()
            assert out[:2] == ["1.0", "ran"]
            assert "\n".join(out[2:-1]) + "\n" == requirements.decode()
            randoms.append(out[-1])
    assert randoms[0] != randoms[1] and len(randoms[0]) == 64
    assert {ref for _, ref in branch.fake.requests} == {"main"}  # only the default branch was ever read

    # an input changes on the default branch: jobs keep the last good base while it is rebuilt
    branch.commits["main"] = {**branch.commits["main"], "requirements.txt": "tinypkg==1.0\nattrs\n"}
    assert bases.template_for(REPO, network=False) == name
    bases.wait(REPO, timeout=900)
    second = engine.templates.get(name)
    assert second.digest != first.digest and len(branch.tarball_refs) == 2
    assert second.manifest["base"]["inputs"]["requirements.txt"] != first.manifest["base"]["inputs"]["requirements.txt"]
    assert bases.template_for(REPO, network=False) == name
    assert len(branch.tarball_refs) == 2  # current again: no third build
