"""Which egress a job's VM gets: the repository's policy, narrowed by the job's own.

A job's policy comes from the pull request itself, so it may only narrow what the operator allowed
the repository (`policy.intersect`); it can never widen it. The repository's policy is the
operator's store file for it or, when the store has none and the service has GitHub App settings,
`.github/microvm-check.yml` on the repository's default branch (never the pull request's head);
either is intersected with the store's org default. With neither, a served repository gets
nothing (deny all). Only `microvm-check run` on the operator's own checkout trusts the job's
policy as given, because there the operator wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import policy
from policy.model import DENY_ALL, Policy
from runner.errors import JobError
from runner.github.errors import GitHubError, RateLimited, Unavailable
from runner.github.policy_source import POLICY_PATH, PolicySource


class EgressPolicyError(JobError):
    """A job policy (or the operator's store) that does not load; the message says where."""


class PolicySourceUnavailable(EgressPolicyError):
    """GitHub, where the repository's policy file is read, is down or rate-limits us: not the job's fault, so
    the API answers 503 with Retry-After (the action and `run` wait and say so), not 400 invalid job."""

    retry_after = 30


@dataclass(frozen=True)
class EgressPolicies:
    policy_dir: Path | None
    trust_job_policy: bool = False
    branch_files: PolicySource | None = None  # the repositories' own files on their default branches

    def effective(self, repository: str, job_policy: str | None) -> Policy:
        """The job's policy: raises EgressPolicyError for a policy that does not load or cannot be read."""
        try:
            if self.trust_job_policy:
                return policy.load_policy(job_policy, "job policy") if job_policy is not None else DENY_ALL
            fallback = (lambda: self._from_branch(repository)) if self.branch_files is not None else None
            return policy.PolicyStore(self.policy_dir).for_job(repository, job_policy, fallback)
        except (policy.PolicyError, ValueError) as exc:
            raise EgressPolicyError(f"policy: {exc}") from exc
        except (Unavailable, RateLimited) as exc:
            raise PolicySourceUnavailable(f"policy: GitHub is unavailable, so {repository}'s {POLICY_PATH} cannot be "
                                          f"read now ({exc}); try again in a little while") from exc
        except GitHubError as exc:
            raise EgressPolicyError(f"policy: cannot read {repository}'s {POLICY_PATH} from GitHub ({exc}); "
                                    "retry, or give the repository a file in the service's policy store") from exc

    def sizes_for(self, repository: str) -> tuple[str, ...]:
        """The size classes the operator's store file allows the repository (none without a store)."""
        try:
            return policy.PolicyStore(self.policy_dir).sizes_for(repository)
        except (policy.PolicyError, ValueError) as exc:
            raise EgressPolicyError(f"policy store: {exc}") from exc

    def templates_for(self, repository: str) -> tuple[str, ...]:
        """The templates the operator's store file offers the repository beyond the service's own."""
        try:
            return policy.PolicyStore(self.policy_dir).templates_for(repository)
        except (policy.PolicyError, ValueError) as exc:
            raise EgressPolicyError(f"policy store: {exc}") from exc

    def debug_for(self, repository: str) -> int | None:
        """The repository's trusted `debug:` keep in seconds (its store file, else its default branch's
        file), None when it sets none; raises EgressPolicyError when the file cannot be read."""
        if self.trust_job_policy:
            return None
        try:
            fallback = (lambda: self._file_from_branch(repository)) if self.branch_files is not None else None
            return policy.PolicyStore(self.policy_dir).debug_for(repository, fallback)
        except (policy.PolicyError, ValueError, GitHubError) as exc:
            raise EgressPolicyError(f"debug: {repository}'s trusted file cannot be read ({exc})") from exc

    def narrowed(self, job_policy: str | None, effective: Policy) -> list[str]:
        """What the job's own policy asked for that its effective one allows nothing of (a job asked
        for `pypi.org:443`, the repository allows nothing): its record says so, in words."""
        if job_policy is None or self.trust_job_policy:
            return []
        try:
            return policy.narrowed_away(policy.load_policy(job_policy, "job policy"), effective)
        except (policy.PolicyError, ValueError):
            return []  # not reached: effective() loaded the same text

    def _from_branch(self, repository: str) -> Policy | None:
        found = self._file_from_branch(repository)
        return None if found is None else found.policy

    def _file_from_branch(self, repository: str) -> policy.RepositoryFile | None:
        assert self.branch_files is not None
        found = self.branch_files.for_repository(repository)
        return None if found is None else policy.load_repository_file(found.text, found.provenance.describe())
