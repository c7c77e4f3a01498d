"""The packages' public APIs, pinned: a name added to or dropped from `__all__` is a decision, not an accident.

Everything else in these packages is internal and may change or go; `tests/test_layers.py` keeps the
other layers from reaching past these names.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "policy": {"AuditRecord", "DENY_ALL", "DNS_ALLOW_CHAIN", "OperatorAllowances", "Policy", "PolicyError",
               "PolicyStore", "Problem", "RenderContext", "RenderedRules", "RepositoryFile", "Rule", "WarmSpec",
               "dns_allow_rule", "intersect", "load_policy", "load_repository_file", "narrowed_away", "render",
               "suggest_policy"},
    "runner.net": {"AuditRecord", "Firewall", "FirewallError", "HostUplink", "NamespaceUplink", "Slot", "SlotError",
                   "SlotPool", "Uplink", "UplinkError", "Upstream"},
    # the VM port (runner/sandbox/port.py) and the in-process Sandbox that implements it
    "runner.sandbox": {"EngineSandboxes", "ExecResult", "Resources", "Sandbox", "SandboxError", "SandboxFactory",
                       "SandboxLike", "SandboxProvider", "VMRequest", "needs_network"},
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_pinned_and_exist(package: str) -> None:
    module = importlib.import_module(package)
    assert set(module.__all__) == PUBLIC[package]
    assert all(hasattr(module, name) for name in module.__all__)
