"""A repository's egress policy file on its default branch: a place the pull request cannot write to.

A pull request (from a fork above all) must not be able to widen its own egress, so the file is
`.github/microvm-check.yml` on the repository's default branch as GitHub reports it; the service
consults it only for repositories its own policy store has no file for (`policy.PolicyStore`).
There is deliberately no parameter for a ref: no caller can ask for the PR head by mistake. Files
are cached by blob sha (and their ETag, so an unchanged file costs a 304 that does not count
against the rate limit).
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import quote

# the policy loader's own limit: a file it would refuse is refused here before it is cached
from policy.load import MAX_BYTES as MAX_POLICY_BYTES
from runner.github.client import Clock, GitHubClient
from runner.github.contents import RepoFile, get_file, list_dir
from runner.github.errors import GitHubError, NotFound
from runner.github.jobs import REPOSITORY_RE

POLICY_PATH = ".github/microvm-check.yml"
BRANCH_TTL = 300.0  # a renamed default branch is picked up within five minutes


@dataclass(frozen=True)
class Provenance:
    """Where a policy came from, for the job record and for error messages."""

    repository: str
    ref: str
    sha: str

    def describe(self) -> str:
        return f"{self.repository}:{POLICY_PATH}@{self.ref} (blob {self.sha})"


@dataclass(frozen=True)
class TrustedPolicy:
    """The YAML text of the default branch's policy file and where it came from."""

    provenance: Provenance
    text: str


class PolicySource:
    """The policy file (and with it the `warm:` section) of each repository's default branch, and
    what a warm base is built from there (`input_blobs`, `tarball`): the App's installation client."""

    def __init__(
        self,
        client: GitHubClient,
        *,
        cache_size: int = 1024,
        clock: Clock = time.monotonic,
    ) -> None:
        self.client = client
        self.clock = clock
        self.cache_size = cache_size
        self._texts: OrderedDict[str, str] = OrderedDict()  # blob sha -> decoded YAML
        self._latest: dict[tuple[str, str], tuple[str | None, str]] = {}  # (repo, branch) -> (etag, sha)
        self._branches: dict[str, tuple[str, float]] = {}  # repo -> (default branch, fetched at)
        self._lock = threading.Lock()

    def for_repository(self, repository: str) -> TrustedPolicy | None:
        """The default branch's policy file, or None when the repository has none."""
        if not REPOSITORY_RE.match(repository):
            raise GitHubError(f"{repository!r} is not an owner/repo name")
        with self._lock:  # the caches are shared by the service's threads; lookups are rare
            return self._from_branch(repository, self.default_branch(repository))

    def default_branch(self, repository: str) -> str:
        cached = self._branches.get(repository)
        if cached and self.clock() - cached[1] < BRANCH_TTL:
            return cached[0]
        try:
            body = self.client.get(f"/repos/{repository}")
        except NotFound as exc:
            raise NotFound(
                f"repository {repository} is not visible to the App: install the App on it to use its policy"
            ) from exc
        branch = body.get("default_branch") if isinstance(body, dict) else None
        if not isinstance(branch, str) or not branch:
            raise GitHubError(f"GitHub did not report a default branch for {repository}")
        self._branches[repository] = (branch, self.clock())
        return branch

    def _from_branch(self, repository: str, branch: str) -> TrustedPolicy | None:
        key = (repository, branch)
        etag, sha = self._latest.get(key, (None, None))
        found = get_file(self.client, repository, POLICY_PATH, branch, etag=etag if sha in self._texts else None)
        if found is None:
            self._latest.pop(key, None)
            return None
        if found.content is not None:  # not a 304: GitHub sent the current file
            sha = found.sha
            self._latest[key] = (found.etag, sha)
            if sha not in self._texts:
                self._remember(sha, self._text(found))
        assert sha is not None  # a 304 is only possible for an ETag we stored with its sha
        self._texts.move_to_end(sha)
        return TrustedPolicy(Provenance(repository, branch, sha), text=self._texts[sha])

    def _text(self, found: RepoFile) -> str:
        where = f"{found.repository}:{found.path}@{found.ref}"
        assert found.content is not None
        if len(found.content) > MAX_POLICY_BYTES:
            raise GitHubError(f"{where} is {len(found.content)} bytes; a policy may be at most {MAX_POLICY_BYTES}")
        try:
            return found.content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GitHubError(f"{where} is not UTF-8 text: a policy is YAML text") from exc

    def _remember(self, sha: str, text: str) -> None:
        self._texts[sha] = text
        while len(self._texts) > self.cache_size:
            self._texts.popitem(last=False)


def input_blobs(client: GitHubClient, repository: str, patterns: tuple[str, ...], ref: str) -> dict[str, str]:
    """The files a `warm:` section's inputs name at `ref`, with their git blob shas: one directory
    listing per directory the patterns name (a pattern's last part is a glob), no file downloaded.
    The shas are content hashes, so they key a warm base without reading a byte of the files."""
    found: dict[str, str] = {}
    for directory in dict.fromkeys(p.rpartition("/")[0] for p in patterns):
        listing = list_dir(client, repository, directory, ref)
        if listing is None:
            continue
        for name, entry in listing.every().items():
            path = f"{directory}/{name}" if directory else name
            if entry.kind == "file" and any(_matches(path, p) for p in patterns):
                found[path] = entry.sha
    return found


def _matches(path: str, pattern: str) -> bool:
    directory, _, name = pattern.rpartition("/")
    path_dir, _, path_name = path.rpartition("/")
    return directory == path_dir and fnmatch.fnmatchcase(path_name, name)


def tarball(client: GitHubClient, repository: str, ref: str, max_bytes: int) -> bytes:
    """The repository's files at `ref` as GitHub's gzipped tarball (one top directory, the commit
    in a pax global header), at most `max_bytes`: the default branch's files a warm base is built
    from. GitHub answers with a redirect to a short-lived download URL, which the client follows
    without the token."""
    if not REPOSITORY_RE.match(repository):
        raise GitHubError(f"{repository!r} is not an owner/repo name")
    response = client.request("GET", f"/repos/{repository}/tarball/{quote(ref, safe='')}")
    declared = response.headers.get("Content-Length")
    if (declared and declared.isdigit() and int(declared) > max_bytes) or len(response.content) > max_bytes:
        raise GitHubError(f"{repository}@{ref}: the repository's tarball is larger than {max_bytes} bytes "
                          "(checkout_max_bytes): a warm base cannot be built from it")
    return response.content
