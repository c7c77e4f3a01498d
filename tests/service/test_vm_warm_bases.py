"""Warm bases per repository (runner.service.bases) on real VMs, against a fake default branch.

GitHub is `responses`: the repository from a real delivery, the contents API (tests/github/repo_fakes)
for the policy file and the input listings, and the tarball endpoint's redirect to a download.
The setup installs a wheel built here from the checkout.
"""

from __future__ import annotations

import functools
import gzip
import io
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import responses

sys.path.insert(0, str(Path(__file__).parents[1] / "github"))  # repo_fakes imports github_fakes by its name

from policy import PolicyStore  # noqa: E402
from runner.github.client import GitHubClient  # noqa: E402
from runner.github.policy_source import PolicySource  # noqa: E402
from runner.sandbox import Sandbox  # noqa: E402
from runner.service.bases import BaseSettings, RepositoryBases, base_name, branch_warm  # noqa: E402
from tests.github.github_fakes import API, load_operations, load_payload  # noqa: E402
from tests.github.repo_fakes import FakeRepo  # noqa: E402
from tests.vm.conftest import template_store  # noqa: E402,F401 - the built template, as in tests/vm

REPO = "listendev/lstn"
WHEEL = "wheels/tinypkg-1.0-py3-none-any.whl"
POLICY = """\
version: 1
warm:
  setup: >-
    python3 -m pip install --quiet --no-index --no-deps --break-system-packages --target /opt/warm
    wheels/tinypkg-1.0-py3-none-any.whl && echo ran >> /opt/setup-runs
  inputs: [requirements*.txt, wheels/*.whl]
"""


def tiny_wheel() -> bytes:
    """A real (minimal) wheel: a module, METADATA, WHEEL and RECORD."""
    out = io.BytesIO()
    files = {
        "tinypkg/__init__.py": "VERSION = '1.0'\n",
        "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "tinypkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(out, "w") as wheel:
        for name, text in {**files, "tinypkg-1.0.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)
    return out.getvalue()


class Binary(str):
    """A file of the fake tree that is not text: the contents fake hashes `encode()`, which gives its bytes."""

    def __new__(cls, data: bytes) -> "Binary":
        text = super().__new__(cls, data.decode("latin-1"))
        text.data = data
        return text

    def encode(self, *args, **kwargs) -> bytes:
        return self.data


class DefaultBranch:
    """The repository's `main` as GitHub serves it: listings, files, and its tarball."""

    def __init__(self, tree: dict[str, str]) -> None:
        self.commits = {"main": {**tree, WHEEL: Binary(tiny_wheel())}}
        self.fake = FakeRepo(load_operations(), REPO, self.commits)
        self.tarball_refs: list[str] = []

    def register(self) -> None:
        responses.get(f"{API}/repos/{REPO}", json=load_payload("listendev-lstn.pull_request.opened.from-fork.json")["repository"])
        self.fake.register()
        download = "https://codeload.github.com/listendev/lstn/legacy.tar.gz/refs/heads/main"
        responses.add_callback(responses.GET, f"{API}/repos/{REPO}/tarball/main",
                               callback=lambda request: (self.tarball_refs.append("main"), (302, {"Location": download}, ""))[1])
        responses.add_callback(responses.GET, download, callback=lambda request: (200, {}, self.tarball()))

    def tarball(self) -> bytes:
        """GitHub's shape: one top directory `owner-repo-sha7`, the commit in a pax global header."""
        commit = "5c3b1f7e" + "0" * 32
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": commit}) as tar:
            top = tarfile.TarInfo(f"listendev-lstn-{commit[:7]}")
            top.type, top.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(top)
            files = {path: text.encode() for path, text in self.commits["main"].items()}
            for path, data in files.items():
                info = tarfile.TarInfo(f"{top.name}/{path}")
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        return gzip.compress(out.getvalue())


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
    bases = RepositoryBases(engine, functools.partial(Sandbox.create, engine=engine),
                            branch_warm(PolicyStore(None), github), github, BaseSettings(parent="base"))
    name = base_name("base", REPO)

    # no base yet: the job would take the bare template, and the base is built beside it
    assert bases.template_for(REPO, network=False) == "base"
    bases.wait(REPO, timeout=900)
    first = engine.templates.get(name)
    assert bases.template_for(REPO, network=False) == name
    assert len(branch.tarball_refs) == 1  # current: the listings said so, nothing was downloaded again
    assert first.manifest["base"]["commit"].startswith("5c3b1f7e")

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
