"""The operator's trusted policy store: an org default and per-repository files on the host.

Layout under the store directory:

    _org.yml              the org default (optional)
    <owner>/<repo>.yml    one repository's policy (optional)

A repository's file may also have a `warm:` section (`policy.warm`), read by `warm_for`; the org
default and a job's policy may not.

Files are read on every call, so an operator's edit applies to the next job without a restart.
Repository names come from webhooks and job specs, so they are validated before they become
paths: nothing outside the store directory can be named. GitHub treats names case-insensitively,
and so does the lookup.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policy.compose import intersect
from policy.load import load_policy
from policy.model import DENY_ALL, Policy
from policy.warm import RepositoryFile, WarmSpec, load_repository_file

ORG_FILE = "_org.yml"
Fallback = Callable[[], "Policy | None"]
FileFallback = Callable[[], "RepositoryFile | None"]
_OWNER = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})")
_REPO = re.compile(r"[A-Za-z0-9._-]{1,100}")


@dataclass(frozen=True)
class PolicyStore:
    directory: Path | None  # None: a service without a store, where only `fallback` can give a policy

    def for_repository(self, repository: str, fallback: Fallback | None = None) -> Policy:
        """The repository's file intersected with the org default; the org default alone when the
        repository has no file; deny-all when neither exists. `fallback` (e.g. the repository's
        own file on its default branch) is asked only when the store has no file for it, and
        stands in for that file. Raises `PolicyError` when a file is invalid (the job must not
        run with a policy nobody meant) and `ValueError` for a name that is not `owner/repo`."""
        owner, repo = split_repository(repository)
        org, own = self._org_file(), self._repository_file(owner, repo)
        layers = [load_policy(org)] if org is not None else []
        if own is not None:
            layers.append(load_repository_file(own).policy)
        if own is None and fallback is not None:
            layers += [found for found in (fallback(),) if found is not None]
        return intersect(*layers) if layers else DENY_ALL

    def for_job(self, repository: str, job_policy: str | None, fallback: Fallback | None = None) -> Policy:
        """The effective policy of one job: the repository's, narrowed by the YAML the job brought
        (the JobSpec's `policy` field). The job's text can only narrow, never widen."""
        policy = self.for_repository(repository, fallback)
        if job_policy is None:
            return policy
        return intersect(policy, load_policy(job_policy, "job policy"))

    def warm_for(self, repository: str, fallback: FileFallback | None = None) -> tuple[WarmSpec, Policy] | None:
        """The repository's `warm:` section and the setup's effective egress (its own policy within
        the org default), or None when it has none. Read from the store file, or, only when there
        is none, from `fallback` (the default branch's file): never from a pull request."""
        owner, repo = split_repository(repository)
        org, own = self._org_file(), self._repository_file(owner, repo)
        found = load_repository_file(own) if own is not None else (fallback() if fallback is not None else None)
        if found is None or found.warm is None:
            return None
        layers = [load_policy(org)] if org is not None else []
        return found.warm, intersect(*layers, found.warm.policy)

    def checks_for(self, repository: str) -> str:
        """The repository's `checks:` setting in its store file (on, off, forks); off without one."""
        owner, repo = split_repository(repository)
        own = self._repository_file(owner, repo)
        found = load_repository_file(own).checks if own is not None else None
        return found or "off"

    def sizes_for(self, repository: str) -> tuple[str, ...]:
        """The size classes the repository's store file allows its jobs (`sizes:`); none without one."""
        owner, repo = split_repository(repository)
        own = self._repository_file(owner, repo)
        return load_repository_file(own).sizes if own is not None else ()

    def templates_for(self, repository: str) -> tuple[str, ...]:
        """The templates the repository's store file offers its jobs beyond the service's own (`templates:`);
        none without one. Never from the repository's own file: it would let a repository name any template on
        the host (another repository's warm base among them)."""
        owner, repo = split_repository(repository)
        own = self._repository_file(owner, repo)
        return load_repository_file(own).templates if own is not None else ()

    def debug_for(self, repository: str, fallback: FileFallback | None = None) -> int | None:
        """The repository's `debug:` keep in seconds (docs/debugging.md), or None when it sets none. Read from
        the store file, or, only when there is none, from `fallback` (the default branch's file): never from
        a pull request."""
        owner, repo = split_repository(repository)
        own = self._repository_file(owner, repo)
        found = load_repository_file(own) if own is not None else (fallback() if fallback is not None else None)
        return None if found is None else found.debug_seconds

    def _org_file(self) -> Path | None:
        if self.directory is None:
            return None
        path = self.directory / ORG_FILE
        return path if path.is_file() else None

    def _repository_file(self, owner: str, repo: str) -> Path | None:
        if self.directory is None:
            return None
        owner_dir = _find_casefold(self.directory, owner, want_dir=True)
        if owner_dir is None:
            return None
        return _find_casefold(owner_dir, f"{repo}.yml", want_dir=False)


def split_repository(repository: str) -> tuple[str, str]:
    """`owner`, `repo` from `owner/repo`, refusing anything that could escape the store."""
    owner, _, repo = repository.partition("/")
    if not _OWNER.fullmatch(owner) or not _REPO.fullmatch(repo) or repo in (".", ".."):
        raise ValueError(f"{repository[:200]!r} is not a repository name; expected 'owner/repo' "
                         "with GitHub's characters")
    return owner, repo


def _find_casefold(directory: Path, name: str, *, want_dir: bool) -> Path | None:
    exact = directory / name
    if (exact.is_dir() if want_dir else exact.is_file()):
        return exact
    try:
        candidates = sorted(directory.iterdir())
    except OSError:
        return None
    for candidate in candidates:
        if candidate.name.casefold() == name.casefold():
            if candidate.is_dir() if want_dir else candidate.is_file():
                return candidate
    return None
