"""Reading one file of a repository at one ref through the contents API.

Both the policy source and the fork guard need "this path, at this exact ref, in this repository"
and nothing looser: a directory, a submodule, an unresolvable symlink or a file too large to be
inlined is an error here, never something to guess around.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from urllib.parse import quote

import requests

from runner.github.client import GitHubClient
from runner.github.errors import GitHubError, NotFound

SHA_RE = re.compile(r"^[0-9a-f]{40}([0-9a-f]{24})?\Z")  # SHA-1 or SHA-256 object names
LISTING_LIMIT = 1000  # entries the contents API lists of one directory (its documented upper limit)
PATH_RE = re.compile(r"^(?!/)(?!.*(^|/)\.\.?(/|$))[^\x00-\x1f]{1,1024}\Z")


@dataclass(frozen=True)
class RepoFile:
    """A file's identity at a ref; `content` is None for metadata-only reads or 304 answers."""

    repository: str
    path: str
    ref: str
    sha: str
    size: int
    content: bytes | None = None
    etag: str | None = None


def check_path(path: str) -> str:
    """A repository-relative path with no `..`, `.` or leading slash, so a ref cannot redirect it."""
    if not PATH_RE.match(path):
        raise GitHubError(f"refusing repository path {path!r}: it must be relative, without '.' or '..' parts")
    return path


def get_file(
    client: GitHubClient, repository: str, path: str, ref: str, *, decode: bool = True, etag: str | None = None
) -> RepoFile | None:
    """The file at `path` on `ref`, or None when it does not exist there.

    With `etag`, GitHub may answer 304 (free of rate limit): the result then has `content=None`
    and the caller reuses what it cached for that ETag.
    """
    url = f"/repos/{repository}/contents/{quote(check_path(path))}"
    try:
        response = client.request(
            "GET", url, params={"ref": ref}, headers={"If-None-Match": etag} if etag else None
        )
    except NotFound:
        return None
    if response.status_code == 304:
        return RepoFile(repository, path, ref, sha="", size=0, content=None, etag=etag)
    return _parse(response, repository, path, ref, decode)


@dataclass(frozen=True)
class Entry:
    """One entry of a directory listing: its kind (`file`, `dir`, `symlink`, `submodule`) and git object sha."""

    kind: str
    sha: str


@dataclass(frozen=True)
class Listing:
    """A directory's entries by name, as the contents API lists them.

    GitHub lists at most LISTING_LIMIT entries of a directory and says nothing when it leaves some
    out: in a listing that long, a name that is missing is unknown, not absent. Reading it as absent
    would make a file hidden at both commits look unchanged, so both accessors refuse instead.
    """

    where: str
    entries: dict[str, Entry]

    @property
    def complete(self) -> bool:
        return len(self.entries) < LISTING_LIMIT

    def get(self, name: str) -> Entry | None:
        entry = self.entries.get(name)
        if entry is None and not self.complete:
            raise GitHubError(f"{self._truncated()}, and {name!r} is not among them: {self._advice()}")
        return entry

    def every(self) -> dict[str, Entry]:
        if not self.complete:
            raise GitHubError(f"{self._truncated()}: {self._advice()}")
        return self.entries

    def _truncated(self) -> str:
        return f"GitHub lists only the first {LISTING_LIMIT:,} entries of {self.where}"

    @staticmethod
    def _advice() -> str:
        return "the guard cannot tell what changed there (keep fewer entries in that directory)"


def list_dir(client: GitHubClient, repository: str, path: str, ref: str) -> Listing | None:
    """The entries of directory `path` (`""` is the root) at `ref`, or None when it is absent.

    The listing names the sha of every entry, a directory's being its tree's, so whole directories
    can be compared between two commits with one request each.
    """
    url = f"/repos/{repository}/contents/{quote(check_path(path) if path else '')}"
    where = f"{repository}:{path or '/'}@{ref}"
    try:
        listing = client.get(url, ref=ref)
    except NotFound:
        return None
    if not isinstance(listing, list):
        raise GitHubError(f"{where} is not a directory")
    entries = {}
    for item in listing:
        name, kind, sha = (item.get(key) if isinstance(item, dict) else None for key in ("name", "type", "sha"))
        if not isinstance(name, str) or not isinstance(kind, str) or not isinstance(sha, str) or not SHA_RE.match(sha):
            raise GitHubError(f"GitHub's listing of {where} has an entry without a valid sha")
        entries[name] = Entry(kind, sha)
    return Listing(where, entries)


def find_entry(client: GitHubClient, repository: str, path: str, ref: str) -> Entry | None:
    """The entry of a file or directory at `ref` from its parent's listing, or None when it is absent."""
    parent, _, name = check_path(path).rpartition("/")
    listing = list_dir(client, repository, parent, ref)
    return listing.get(name) if listing else None


def entry_sha(client: GitHubClient, repository: str, path: str, ref: str) -> str | None:
    """The git object sha of a file or directory (its tree) at `ref`, or None when it is absent."""
    entry = find_entry(client, repository, path, ref)
    return entry.sha if entry else None


def _parse(response: requests.Response, repository: str, path: str, ref: str, decode: bool) -> RepoFile:
    where = f"{repository}:{path}@{ref}"
    try:
        body = response.json()
    except ValueError as exc:
        raise GitHubError(f"GitHub's answer for {where} is not JSON") from exc
    if not isinstance(body, dict) or body.get("type") != "file":
        kind = body.get("type") if isinstance(body, dict) else "directory"
        raise GitHubError(f"{where} is a {kind}, not a file: it must be a regular file")
    sha, size = body.get("sha"), body.get("size")
    if not isinstance(sha, str) or not SHA_RE.match(sha) or not isinstance(size, int):
        raise GitHubError(f"GitHub's answer for {where} lacks a valid sha or size")
    content = _decode(body, where) if decode else None
    return RepoFile(repository, path, ref, sha, size, content, etag=response.headers.get("ETag"))


def _decode(body: dict[str, object], where: str) -> bytes:
    content = body.get("content")
    if body.get("encoding") != "base64" or not isinstance(content, str):
        raise GitHubError(f"{where} is too large to be read through the contents API (over 1 MB)")
    try:
        data = base64.b64decode("".join(content.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise GitHubError(f"GitHub sent {where} with invalid base64 content") from exc
    if len(data) != body["size"]:
        raise GitHubError(f"GitHub sent {where} with {len(data)} bytes but announced {body['size']}")
    return data
