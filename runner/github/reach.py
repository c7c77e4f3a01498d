"""What a fork's pull request changes that a `pull_request` job would run on the host.

Such a job runs the workflow as the pull request has it, and with it every same-repository
workflow it calls (`jobs.<id>.uses: ./.github/workflows/x.yml`) and every local action a step uses
(`uses: ./path`, or `$/path`, recursively through composite actions). Comparing only the caller file misses a
fork that leaves it alone and rewrites what it calls, so this module compares, between the PR's
base and head commits:

- the `.github` directory as a whole (one root listing per commit names its tree sha), minus the
  paths the operator lets forks change (`fork_may_change`, e.g. issue templates);
- each workflow and local action the job's workflow reaches, found by a bounded walk.

The walk reads further references only from files that are identical at both commits, so the
only YAML it parses is the base's: a fork cannot steer the walk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from runner.github.client import GitHubClient
from runner.github.contents import Entry, RepoFile, check_path, find_entry, get_file, list_dir
from runner.github.errors import GitHubError

GITHUB_DIR = ".github"
MAX_REACHED = 32  # workflows and actions one job's walk follows; more is refused, not guessed
MAX_LISTINGS = 16  # directories compared under .github when some of it may change
MAX_ACTION_LISTINGS = 16  # directories of one action searched for symbolic links
RUNS_FILES = ("main", "pre", "post", "image")  # `runs:` keys the runner joins to the action's directory
ACTION_FILES = ("action.yml", "action.yaml")
LOCAL_PREFIXES = ("./", ".\\", "$/")  # how a `uses:` names this repository (see _locals)
# How a reached thing differs. "changed", "added", "removed": between base and head; "root": a
# `uses: ./` action is the whole repository, which every pull request changes; "unresolvable": a
# path the guard cannot compare (`..`, a backslash, a symlink or submodule as an action); "unparseable": YAML
# the guard cannot read; "missing": absent at both commits (the guard fails closed: a workflow it
# cannot read is one it cannot vouch for); "too-many": the walk hit MAX_REACHED. For an action whose
# directory is unchanged: "linked", it holds a symbolic link (the checkout follows it to a file the
# fork may have rewritten, while the tree sha covers only the link's text); "escapes", its `runs`
# names a file outside its directory (`main: ../../dist/index.js`); "too-big", more than
# MAX_ACTION_LISTINGS directories to search for links.
Status = Literal[
    "changed", "added", "removed", "root", "unresolvable", "unparseable", "missing", "too-many",
    "linked", "escapes", "too-big",
]


@dataclass(frozen=True)
class Target:
    """A workflow file or a local action directory, relative to the repository root."""

    kind: Literal["workflow", "action"]
    path: str


@dataclass(frozen=True)
class Change:
    target: Target
    status: Status


@dataclass(frozen=True)
class Revisions:
    """One repository at the pull request's base and head commits (fork commits are readable in
    the base repository, which keeps refs/pull/N/head)."""

    client: GitHubClient
    repository: str
    base: str
    head: str

    def root_entry(self, ref: str, name: str) -> Entry | None:
        """`name` in the root listing at `ref`. A commit always has a root: a 404 means the App
        cannot see the repository (GitHub hides what it may not read), which must not pass for
        "nothing there"."""
        root = list_dir(self.client, self.repository, "", ref)
        if root is None:
            raise GitHubError(
                f"GitHub shows no files of {self.repository} at {ref}: check that the App is installed "
                "on the repository with the permission contents: read"
            )
        return root.get(name)

    def listings(self, path: str) -> tuple[dict[str, Entry], dict[str, Entry]]:
        return self.listing(path, self.base), self.listing(path, self.head)

    def listing(self, path: str, ref: str) -> dict[str, Entry]:
        """Every entry of directory `path` at `ref` (none when it is absent)."""
        listing = list_dir(self.client, self.repository, path, ref)
        return listing.every() if listing else {}

    def file(self, path: str, ref: str, *, decode: bool) -> RepoFile | None:
        return get_file(self.client, self.repository, path, ref, decode=decode)

    def entry(self, path: str, ref: str) -> Entry | None:
        return find_entry(self.client, self.repository, path, ref)


@dataclass(frozen=True)
class GithubDiff:
    """`same`: `.github` has one tree sha at base and head. `refused`: what differs there that
    `fork_may_change` does not cover (`(".github",)` when nothing may change)."""

    same: bool
    refused: tuple[str, ...] = ()


def github_changes(rev: Revisions, may_change: tuple[str, ...]) -> GithubDiff:
    """Compares `.github` between base and head: by its tree sha alone, or when some of it may
    change, directory by directory down to the allowed paths (at most MAX_LISTINGS directories;
    past that, whatever differs counts as refused)."""
    if rev.root_entry(rev.base, GITHUB_DIR) == rev.root_entry(rev.head, GITHUB_DIR):
        return GithubDiff(same=True)
    if not may_change:
        return GithubDiff(same=False, refused=(GITHUB_DIR,))
    return GithubDiff(same=False, refused=tuple(_differing(rev, GITHUB_DIR, may_change, [MAX_LISTINGS])))


def _differing(rev: Revisions, path: str, may_change: tuple[str, ...], budget: list[int]) -> Iterator[str]:
    """Differing entries under `path`, descending only into directories that hold an allowed path."""
    budget[0] -= 1
    base, head = rev.listings(path)
    for name in sorted(set(base) | set(head)):
        child = f"{path}/{name}"
        if base.get(name) == head.get(name) or _covered(child, may_change):
            continue
        both_dirs = all(entry is None or entry.kind == "dir" for entry in (base.get(name), head.get(name)))
        if both_dirs and budget[0] > 0 and any(allowed.startswith(f"{child}/") for allowed in may_change):
            yield from _differing(rev, child, may_change, budget)
        else:
            yield child


def _covered(path: str, may_change: tuple[str, ...]) -> bool:
    return any(path == allowed or path.startswith(f"{allowed}/") for allowed in may_change)


def reached_changes(rev: Revisions, workflow: str, github_unchanged: bool) -> list[Change]:
    """Every workflow or local action the job's workflow reaches that differs between base and head.

    `github_unchanged`: `.github` has one tree sha at both commits, so nothing under it needs comparing
    (only reading, to follow its references).
    """
    compare = _Compare(rev, github_unchanged)
    queue: deque[Target] = deque([Target("workflow", workflow)])
    seen: set[Target] = set()
    changes: list[Change] = []
    while queue:
        target = queue.popleft()
        if target in seen:
            continue
        if len(seen) == MAX_REACHED:
            return [*changes, Change(target, "too-many")]
        seen.add(target)
        status, text = compare.workflow(target.path) if target.kind == "workflow" else compare.action(target.path)
        if status is None and text is not None:
            try:
                queue.extend(local_uses(text))
            except ValueError:
                status = "unparseable"
        if status is not None:
            changes.append(Change(target, status))
    return changes


@dataclass(frozen=True)
class _Compare:
    rev: Revisions
    github_unchanged: bool

    def _known_same(self, path: str) -> bool:
        return self.github_unchanged and path.startswith(f"{GITHUB_DIR}/")

    def workflow(self, path: str) -> tuple[Status | None, str | None]:
        """How the workflow file differs (None: it does not), and its text when it does not."""
        if not _checkable(path):
            return "unresolvable", None
        base = self.rev.file(path, self.rev.base, decode=True)
        head = base if self._known_same(path) else self.rev.file(path, self.rev.head, decode=False)
        status = _status(base.sha if base else None, head.sha if head else None)
        if status or base is None or base.content is None:
            return status or "missing", None
        return None, base.content.decode("utf-8", errors="replace")

    def action(self, path: str) -> tuple[Status | None, str | None]:
        """How the action's directory differs or reaches beyond itself (None: it does neither), and
        its metadata's text."""
        if path == "":
            return "root", None
        if not _checkable(path):
            return "unresolvable", None
        if not self._known_same(path):
            base, head = self.rev.entry(path, self.rev.base), self.rev.entry(path, self.rev.head)
            if any(entry is not None and entry.kind != "dir" for entry in (base, head)):
                return "unresolvable", None  # a symlink's target or a submodule's content is not in its sha
            status = _status(base.sha if base else None, head.sha if head else None)
            if status or base is None:
                return status or "missing", None
        text = self._metadata(path)
        if text is None:
            return "missing", None
        return self._links(path) or _escapes(text), text

    def _metadata(self, path: str) -> str | None:
        for name in ACTION_FILES:
            found = self.rev.file(f"{path}/{name}", self.rev.base, decode=True)
            if found is not None and found.content is not None:
                return found.content.decode("utf-8", errors="replace")
        return None

    def _links(self, path: str) -> Status | None:
        """Status "linked" when the action's directory holds a symbolic link, at any depth (the
        directory is the same at both commits, so the base's listings tell)."""
        directories, budget = deque([path]), MAX_ACTION_LISTINGS
        while directories:
            if budget == 0:
                return "too-big"
            budget -= 1
            directory = directories.popleft()
            for name, entry in self.rev.listing(directory, self.rev.base).items():
                if entry.kind == "symlink":
                    return "linked"
                if entry.kind == "dir":
                    directories.append(f"{directory}/{name}")
        return None


def _escapes(text: str) -> Status | None:
    """Status "escapes" when the action's `runs` names a file outside its directory: the runner joins `main`,
    `pre`, `post` and a Dockerfile `image` to the directory without a check, so `../../dist/x.js` runs
    a file the guard never compared. Unreadable YAML is "unparseable"."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        return "unparseable"
    runs = document.get("runs") if isinstance(document, dict) else None
    if not isinstance(runs, dict):
        return None
    for key in RUNS_FILES:
        value = runs.get(key)
        if isinstance(value, str) and not value.startswith("docker://"):
            parts = value.replace("\\", "/").split("/")
            if value.startswith(("/", "\\")) or ".." in parts:
                return "escapes"
    return None


def _checkable(path: str) -> bool:
    if "\\" in path:
        return False
    try:
        check_path(path)
    except GitHubError:
        return False
    return True


def _status(base: str | None, head: str | None) -> Status | None:
    if base == head:
        return None
    if base is None:
        return "added"
    return "removed" if head is None else "changed"


def local_uses(text: str) -> list[Target]:
    """The same-repository workflows and local actions a workflow or action file refers to:
    `jobs.<id>.uses` and `jobs.<id>.steps[].uses` in a workflow, `runs.steps[].uses` in a composite
    action, each starting with `./`. Raises ValueError when the text is not YAML."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from exc
    if not isinstance(document, dict):
        return []
    targets = []
    jobs = document.get("jobs")
    for job in jobs.values() if isinstance(jobs, dict) else ():
        if isinstance(job, dict):
            targets += _locals([job.get("uses")], "workflow") + _locals(_step_uses(job.get("steps")), "action")
    runs = document.get("runs")
    if isinstance(runs, dict):
        targets += _locals(_step_uses(runs.get("steps")), "action")
    return targets


def _step_uses(steps: Any) -> list[Any]:
    return [step.get("uses") for step in steps if isinstance(step, dict)] if isinstance(steps, list) else []


def _locals(values: list[Any], kind: Literal["workflow", "action"]) -> list[Target]:
    """`./a/b/` becomes `a/b`, `./` the root (`""`); other values (remote, docker) are not ours to compare.

    The runner takes three spellings as this repository: `./` and `.\\` (the workspace) and `$/` (this
    repository at the workflow's own commit, which for a pull request is the merge of the fork's
    changes). A backslash is kept in the path, which makes it one the guard cannot compare: on Linux
    it is part of a name, and a fork can create that name.
    """
    targets = []
    for value in values:
        prefix = next((p for p in LOCAL_PREFIXES if isinstance(value, str) and value.startswith(p)), None)
        if prefix is not None:
            targets.append(Target(kind, value[len(prefix):].strip("/")))
    return targets

