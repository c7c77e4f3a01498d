"""A repository at several commits behind a fake contents API (`GET /repos/{o}/{r}/contents/{path}?ref=`).

Answers are GitHub's documented example bodies (a file, a directory listing's file and dir entries)
with this repository's names, contents and shas filled in. Files get their real git blob sha; a
directory's sha is a digest of its entries, which, like git's tree sha, changes exactly when
something below it changes.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import responses

from tests.github.github_fakes import API, CONTENTS_FILE, CONTENTS_OP, example

DIRECTORY = "application/json:response-if-content-is-a-directory"
LISTING_LIMIT = 1000  # "This API has an upper limit of 1,000 files for a directory" (the operation's description)
Tree = Mapping[str, str]  # path -> text of one commit's files


class Link(str):
    """A symbolic link in a tree: git stores its target as the blob's content."""


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeRepo:
    def __init__(self, operations: dict[str, Any], repository: str, commits: Mapping[str, Tree]) -> None:
        self.repository = repository
        self.commits = commits
        self.file_body = example(operations, CONTENTS_OP, "200", CONTENTS_FILE)
        self.file_entry, self.dir_entry = example(operations, CONTENTS_OP, "200", DIRECTORY)
        self.requests: list[tuple[str, str]] = []  # (path, ref) in the order asked

    def register(self, mock: Any = responses) -> None:
        url = re.compile(rf"{re.escape(API)}/repos/{re.escape(self.repository)}/contents/.*")
        mock.add_callback(responses.GET, url, callback=self._answer)

    def _answer(self, request: Any) -> tuple[int, dict, str]:
        parts = urlsplit(request.url)
        path = unquote(parts.path.split("/contents/", 1)[1]).strip("/")
        ref = parse_qs(parts.query).get("ref", [""])[0]
        self.requests.append((path, ref))
        tree = self.commits.get(ref)
        if tree is None:
            return 404, {}, json.dumps({"message": "No commit found for the ref " + ref})
        if isinstance(tree.get(path), Link):
            return 200, {}, json.dumps(self._link(tree, path))
        if path in tree:
            return 200, {}, json.dumps(self._file(path, tree[path].encode()))
        entries = self._entries(tree, path)
        if not entries:
            return 404, {}, json.dumps({"message": "Not Found"})
        return 200, {}, json.dumps(entries[:LISTING_LIMIT])

    def _file(self, path: str, data: bytes) -> dict:
        body = copy.deepcopy(self.file_body)
        body.update(path=path, name=path.rpartition("/")[2], size=len(data), sha=blob_sha(data),
                    content=base64.b64encode(data).decode())
        return body

    def _link(self, tree: Tree, path: str) -> dict:
        """As GitHub answers for a symlink: the target's file when it is a regular file of the tree,
        else an object describing the link (here: the file shape with type symlink and its target)."""
        target = posixpath.normpath(posixpath.join(posixpath.dirname(path), tree[path]))
        if target in tree and not isinstance(tree[target], Link):
            return self._file(target, tree[target].encode())
        body = self._file(path, tree[path].encode())
        body.update(type="symlink", target=str(tree[path]))
        return body

    def _entries(self, tree: Tree, directory: str) -> list[dict]:
        prefix = f"{directory}/" if directory else ""
        names = sorted({path[len(prefix):].split("/", 1)[0] for path in tree if path.startswith(prefix)})
        return [self._entry(tree, f"{prefix}{name}") for name in names]

    def _entry(self, tree: Tree, path: str) -> dict:
        if path in tree:
            entry = copy.deepcopy(self.file_entry)
            data = tree[path].encode()
            entry.update(type="symlink" if isinstance(tree[path], Link) else "file", size=len(data), sha=blob_sha(data))
        else:
            entry = copy.deepcopy(self.dir_entry)
            entry.update(type="dir", sha=self.tree_sha(tree, path))
        entry.update(name=path.rpartition("/")[2], path=path)
        return entry

    def tree_sha(self, tree: Tree, directory: str) -> str:
        listing = [(entry["name"], entry["type"], entry["sha"]) for entry in self._entries(tree, directory)]
        return hashlib.sha1(json.dumps(listing).encode()).hexdigest()
