"""Which template a VM restores from: the one place it is decided, for every VM the service makes.

A job names a template (or has the service's default) and may ask for a size class; a repository may
have a warm base of that template (runner/service/jobs/bases.py). The workers (a job's VM, and the first
step of a kept VM, whose later steps keep its choice), the pre-warming reactions (a VM restored for a
queued job, claimed only by a submit that chose the same template) and the interactive sandboxes all ask
`choose_template`, so two of them can never disagree about the same job. The engine below only picks the
network variant of the chosen template's snapshot, from whether the VM has a network card.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from policy.model import Policy
from runner.jobapi.contract import canonical_repository
from runner.sandbox.port import TemplateChoice, needs_network
from runner.vm.templates import sized

if TYPE_CHECKING:
    from runner.service.jobs.bases import RepositoryBases


def choose_template(named: str, *, size: str | None = None, repository: str | None = None,
                    policy: Policy | None = None, bases: RepositoryBases | None = None) -> TemplateChoice:
    """The template a VM for `repository` restores from when `named` is asked for: `named` baked at the
    size class `size` (admission checked the repository may use it); else the repository's warm base of
    the VM's network variant (its card follows from `policy`) when `named` is the bases' parent and one is
    ready; else `named`. Choosing a base may ask GitHub whether it is current: call it off the webhook's
    and the API's threads (a worker, a pre-warm's restore)."""
    if size is not None:
        return TemplateChoice(sized(named, size), warm_base=False, size=size,
                              why=f"the template {named} baked at the size class {size} the job asks for")
    if bases is None or repository is None or named != bases.settings.parent:
        return TemplateChoice(named, warm_base=False, size=None, why=f"the template {named}")
    template = bases.template_for(canonical_repository(repository), needs_network(policy))
    if template == named:
        return TemplateChoice(named, warm_base=False, size=None,
                              why=f"the template {named} (the repository has no base of this network variant ready)")
    return TemplateChoice(template, warm_base=True, size=None, why=f"the repository's warm base {template}")
