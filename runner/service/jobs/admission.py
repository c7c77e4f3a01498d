"""Admission: what a client sent, checked before anything is spent on it.

The spec is validated (runner/service/jobs/spec.py), the caller's right to submit it for its GitHub job
is checked (runner/service/jobs/auth.py), the repository it runs as and its runner decided, its size class
checked against the repository's and the effective egress policy of that repository looked up, all before
the job's one AdmittedSpec is built;
a `keep: job` step finds its session; a checkout is spooled within its limit and
checked as a tar. Whatever is refused here is a client's error (400, 403, 409, 413).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from policy.model import Policy
from runner.errors import ArchiveError, JobError
from runner.sandbox.port import needs_network
from runner.service.config.settings import ServiceConfig
from runner.service.jobs.auth import Access, Caller
from runner.service.jobs.egress import EgressPolicies, EgressPolicyError, PolicySourceUnavailable
from runner.service.jobs.job import CHECKOUT, Admitted, AdmittedSpec, JobRun
from runner.service.jobs.secretbindings import SecretAdmission
from runner.service.jobs.sessions import Session, Sessions, session_key
from runner.service.jobs.spec import SpecError, parse_submission
from runner.tarsafe import check_tar


class InvalidJob(JobError):
    """The job as sent cannot run here: its spec, its egress policy or its checkout."""


class TooLarge(JobError):
    """A request body over the service's limit for it."""


class Admission:
    def __init__(self, config: ServiceConfig, access: Access, policies: EgressPolicies, sessions: Sessions) -> None:
        self.config, self.access, self.policies, self.sessions = config, access, policies, sessions
        self.secrets = SecretAdmission(config.secrets)  # the operator's bindings: values in memory only

    def admit(self, data: object, caller: Caller) -> Admitted:
        """The job's spec, built once from what was sent and what the service decides of it, its
        effective policy and its secret bindings (the operator's for its repository, and the workflow's
        when `Access` trusts the workflow); or a JobError; reserves nothing. The caller is checked before
        the policy is looked up: the policy comes from the repository it may submit for."""
        try:
            submitted = parse_submission(data, self.config)
            runner = self.access.admit_submit(caller, submitted)
            # the name GitHub gave the runner (not the submit's spelling of it), or the local jobs' name
            repository = self.access.repository_for(caller, submitted)
            policy = self.policies.effective(repository, submitted.policy)
            submitted.check_size(repository, self.policies.sizes_for(repository))
            submitted.check_template(repository, self.policies.templates_for(repository))
            spec = submitted.spec(repository, runner or "")
            if submitted.secrets:
                self.access.refuse_workflow_secrets(caller, submitted, spec.event)
            bound = self.secrets.for_job(spec, submitted.secrets, lambda: self._trusted_policy(spec, policy))
        except PolicySourceUnavailable:
            raise  # GitHub is down: 503, try again (not an invalid job)
        except (SpecError, EgressPolicyError) as exc:
            raise InvalidJob(f"invalid job: {exc}") from exc
        if needs_network(policy) and not self.config.network.enabled:
            raise InvalidJob(f"the egress policy for {spec.repository} allows network access, but this service "
                             f"runs VMs without networking (network.enabled is false in its config): narrow the "
                             f"policy to deny all, or ask the operator to enable networking")
        return Admitted(spec, policy, bound)

    def _trusted_policy(self, spec: AdmittedSpec, policy: Policy) -> Policy:
        """The repository's trusted policy, not narrowed by the job's own (what a workflow's secret binding
        is held to); `run` trusts the job's as given."""
        return policy if self.policies.trust_job_policy else self.policies.effective(spec.repository, None)

    def session_for(self, spec: AdmittedSpec, policy: Policy,
                      token: str | None) -> tuple[Session | None, str | None]:
        """The GitHub job's kept VM this step opens (`keep: job` without a session's token: a new
        session and its token) or attaches to (the token of a session of this very job), or None.
        The key carries the runner the binding admitted and the token only the job has, so no other
        job finds it, whatever it claims."""
        key = session_key(spec)
        if key is None:
            if spec.keep == "job":
                raise InvalidJob("keep: job needs the GitHub job's run_id and job_name (the action sends them)")
            return None, None
        return self.sessions.join(key, spec.keep, spec.template, spec.size, policy.digest(), token)


def spool_checkout(run: JobRun, chunks: Iterable[bytes], limit: int) -> None:
    """Write the checkout tar into the job's directory, at most `limit` bytes, and check it is a tar the
    guest may get (runner/tarsafe.py) before it takes the place of the job's checkout."""
    part = run.dir / f"{CHECKOUT}.part"
    written = 0
    try:
        with open(part, "wb") as out:
            for chunk in chunks:
                written += len(chunk)
                if written > limit:
                    raise TooLarge(f"the checkout is larger than the service's limit of {limit} bytes; "
                                   f"leave build outputs out or ask the operator to raise checkout_max_bytes")
                out.write(chunk)
        with open(part, "rb") as check:
            check_tar(check)
        os.replace(part, run.checkout_path)
    except ArchiveError as exc:
        raise InvalidJob(f"checkout: {exc}") from exc
    finally:
        if part.exists():
            part.unlink()
