"""Egress policy for microvm-check guests: YAML in, iptables documents out.

Public API (everything else is internal):

- `load_policy(source, source_name=None) -> Policy`: `source` is a `Path` (a file) or `str` (YAML
  text); raises `PolicyError` (a list of `Problem(file, line, column, message)`) for anything wrong.
- `Policy(version, mode, rules)`, `Rule(ports, protocol, host=None, network=None)`: frozen and
  normalised; `Policy.digest()` is the `sha256:...` recorded in job records,
  `Policy.rules_for_host(name)` is what the DNS resolver asks before allowing an answer.
- `intersect(a, *more) -> Policy`: the effective policy of several layers (never wider than any).
- `PolicyStore(directory).for_repository("owner/repo")` and `.for_job(repository, job_yaml)`;
  `.warm_for(repository)`: a repository file's `warm:` section (`load_repository_file`, `WarmSpec`).
- `render(policy, RenderContext(...), OperatorAllowances(...)) -> RenderedRules(ipv4, ipv6)`;
  `dns_allow_rule(ip, ports, protocol)` is the rule shape the resolver appends to `MVC-DNS-ALLOW`.
- `narrowed_away(requested, effective) -> list[str]`: a job policy's entries its effective policy
  allows nothing of, in words (the job record's `narrowed_egress`).
- `suggest_policy(records) -> str`: block-mode policy YAML that allows what an audit run tried, from
  its `AuditRecord`s (`microvm_check.entries.AuditRecord`: `to_wire()` is a job record's `blocked_egress`
  entry, `from_wire()` reads one back).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names, for type checkers; at run time each loads on first use (PEP 562, below)
    from policy.compose import intersect, narrowed_away
    from policy.load import PolicyError, load_policy
    from policy.model import DENY_ALL, Policy, Rule
    from policy.render import DNS_ALLOW_CHAIN, OperatorAllowances, RenderContext, RenderedRules, dns_allow_rule, render
    from policy.store import PolicyStore
    from policy.suggest import AuditRecord, suggest_policy
    from policy.warm import RepositoryFile, WarmSpec, load_repository_file
    from policy.yamldoc import Problem

# Lazy so that `microvm-check policy check` (which needs only policy.load) does not import jinja2 and the
# renderer, store and suggester on every start (issue 26). Public name -> the module that defines it.
_HOME = {
    "intersect": "compose", "narrowed_away": "compose", "PolicyError": "load", "load_policy": "load",
    "DENY_ALL": "model", "Policy": "model", "Rule": "model", "DNS_ALLOW_CHAIN": "render",
    "OperatorAllowances": "render", "RenderContext": "render", "RenderedRules": "render",
    "dns_allow_rule": "render", "render": "render", "PolicyStore": "store", "AuditRecord": "suggest",
    "suggest_policy": "suggest", "RepositoryFile": "warm", "WarmSpec": "warm",
    "load_repository_file": "warm", "Problem": "yamldoc",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'policy' has no attribute {name!r}")
    module = import_module(f"policy.{home}")
    # bind all of that module's public names now: importing policy.render sets the package attribute
    # `render` to the submodule, which the function of that name must replace
    globals().update({public: getattr(module, public) for public, where in _HOME.items() if where == home})
    return globals()[name]


__all__ = [
    "AuditRecord", "DENY_ALL", "DNS_ALLOW_CHAIN", "OperatorAllowances", "Policy", "PolicyError", "PolicyStore",
    "Problem", "RenderContext", "RenderedRules", "RepositoryFile", "Rule", "WarmSpec", "dns_allow_rule",
    "intersect", "load_policy", "load_repository_file", "narrowed_away", "render", "suggest_policy",
]
