"""The rendered documents against the real iptables binaries, inside throwaway network namespaces.

`unshare -n` gives each command a namespace of its own that disappears with the process, so
nothing touches the machine's real tables and nothing is left behind. No packet is sent.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from policy import dns_allow_rule, render
from tests.policy.test_policy_render import CASES

pytestmark = pytest.mark.netns


def in_fresh_namespace(script: str, *files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-n", "sh", "-ec", script, "sh", *map(str, files)],
                          capture_output=True, text=True, timeout=60)


def rule_lines(document: str) -> list[str]:
    return [line for line in document.splitlines() if line.startswith("-A ")]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family, tool", [("ipv4", "iptables"), ("ipv6", "ip6tables")])
def test_restore_accepts_the_document_and_loads_every_rule(need_netns, tmp_path: Path, case, family, tool):
    policy, context, allowances = CASES[case]
    document = getattr(render(policy, context, allowances), family)
    path = tmp_path / "rules"
    path.write_text(document)
    checked = in_fresh_namespace(f'{tool}-restore --test < "$1"', path)
    assert checked.returncode == 0, checked.stderr
    loaded = in_fresh_namespace(f'{tool}-restore < "$1"; {tool}-save -t filter', path)
    assert loaded.returncode == 0, loaded.stderr
    assert len(rule_lines(loaded.stdout)) == len(rule_lines(document))
    assert ":FORWARD DROP" in loaded.stdout


@pytest.mark.parametrize("address, tool", [("151.101.0.223", "iptables"), ("2a04:4e42::223", "ip6tables")])
def test_resolver_rules_append_to_the_rendered_chain(need_netns, tmp_path: Path, address, tool):
    policy, context, allowances = CASES["block"]
    rendered = render(policy, context, allowances)
    path = tmp_path / "rules"
    path.write_text(rendered.ipv4 if tool == "iptables" else rendered.ipv6)
    lines = dns_allow_rule(address, range(1, 40, 2), "tcp").splitlines()
    appends = "; ".join(f"{tool} {line}" for line in lines)
    loaded = in_fresh_namespace(f'{tool}-restore < "$1"; {appends}; {tool}-save -t filter', path)
    assert loaded.returncode == 0, loaded.stderr
    assert len([line for line in rule_lines(loaded.stdout) if line.startswith("-A MVC-DNS-ALLOW")]) == len(lines) == 2


def test_a_broken_document_is_rejected(need_netns, tmp_path: Path):
    """The check above can fail: iptables-restore --test refuses a rule iptables cannot load."""
    policy, context, allowances = CASES["block"]
    path = tmp_path / "rules"
    path.write_text(render(policy, context, allowances).ipv4.replace("--dports 53 ", "--dports 70000 "))
    checked = in_fresh_namespace('iptables-restore --test < "$1"', path)
    assert checked.returncode != 0 and "70000" in checked.stderr
