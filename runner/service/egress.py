"""Which egress a job's VM gets: the repository's policy, narrowed by the job's own.

A job's policy comes from the pull request itself, so it may only narrow what the operator allowed
the repository (`policy.intersect`); it can never widen it. Without a policy store a served
repository gets nothing (deny all). Only `microvm-check run` on the operator's own checkout trusts
the job's policy as given, because there the operator wrote it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import policy
from policy.model import DENY_ALL, Policy


class EgressPolicyError(ValueError):
    """A job policy (or the operator's store) that does not load; the message says where."""


@dataclass(frozen=True)
class EgressPolicies:
    policy_dir: Path | None
    trust_job_policy: bool = False

    def effective(self, repository: str, job_policy: str | None) -> Policy:
        """The job's policy: raises EgressPolicyError for a job policy (or a store file) that does not load."""
        try:
            if self.trust_job_policy:
                return policy.load_policy(job_policy, "job policy") if job_policy is not None else DENY_ALL
            if self.policy_dir is None:  # no store: the repository gets nothing, the job can only narrow that
                return DENY_ALL if job_policy is None else policy.intersect(DENY_ALL, policy.load_policy(job_policy, "job policy"))
            return policy.PolicyStore(self.policy_dir).for_job(repository, job_policy)
        except (policy.PolicyError, ValueError) as exc:
            raise EgressPolicyError(f"policy: {exc}") from exc
