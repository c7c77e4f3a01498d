"""A repository with a `warm:` section on a fake default branch, for the warm base tests on real VMs.

GitHub is `responses`: the repository from a real delivery, the contents API (tests/github/repo_fakes)
for the policy file and the input listings, and the tarball endpoint's redirect to a download, at
the branch or at any commit the test adds. The setup installs a wheel built here.
"""

from __future__ import annotations

import gzip
import io
import re
import tarfile
import zipfile

import responses

from tests.github.github_fakes import API, load_operations, load_payload
from tests.github.repo_fakes import FakeRepo

REPO = "listendev/lstn"
WHEEL = "wheels/tinypkg-1.0-py3-none-any.whl"
FIRST_COMMIT = "5c3b1f7e" + "0" * 32
DOWNLOAD = "https://codeload.github.com/listendev/lstn/legacy.tar.gz/"
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

    def __new__(cls, data: bytes) -> Binary:
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
        self.head = FIRST_COMMIT

    def register(self) -> None:
        responses.get(f"{API}/repos/{REPO}", json=load_payload("listendev-lstn.pull_request.opened.from-fork.json")["repository"])
        self.fake.register()
        responses.add_callback(responses.GET, re.compile(re.escape(f"{API}/repos/{REPO}/tarball/") + r"[^/?]+$"),
                               callback=self._redirect)
        responses.add_callback(responses.GET, re.compile(re.escape(DOWNLOAD) + r"[^/?]+$"),
                               callback=lambda request: (200, {}, self.tarball(request.url.rpartition("/")[2])))

    def push(self, commit: str, changes: dict[str, str]) -> None:
        """A new commit on the default branch: the branch and the commit itself now hold the changed tree."""
        self.commits["main"] = self.commits[commit] = {**self.commits["main"], **changes}
        self.head = commit

    def _redirect(self, request) -> tuple[int, dict, str]:
        ref = request.url.rpartition("/")[2]
        self.tarball_refs.append(ref)
        return 302, {"Location": DOWNLOAD + ref}, ""

    def tarball(self, ref: str = "main") -> bytes:
        """GitHub's shape: one top directory `owner-repo-sha7`, the commit in a pax global header."""
        commit = self.head if ref == "main" else ref
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": commit}) as tar:
            top = tarfile.TarInfo(f"listendev-lstn-{commit[:7]}")
            top.type, top.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(top)
            files = {path: text.encode() for path, text in self.commits[ref].items()}
            for path, data in files.items():
                info = tarfile.TarInfo(f"{top.name}/{path}")
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        return gzip.compress(out.getvalue())
