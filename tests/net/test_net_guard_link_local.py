"""The slot's raw guard alone keeps the guest from the metadata address (policy/render.py,
guard4's `-d 169.254.0.0/16 -j MVC-DENIED`).

The policy's FORWARD rules deny link-local too, so with both in place removing the guard's rule
changes nothing a guest can see. Here the live FORWARD chain is made to admit the metadata address
(an ACCEPT ahead of every rule, under an audit-mode policy that lets the rest through), as a policy
or renderer bug would: the guard must still refuse it, and log it as always denied. The first test
shows the topology carries the traffic once the guard is skipped too, so the second can fail. The
guard is skipped by a rule inserted ahead of it, not by deleting its rule, so that code without
that rule fails the second test at its assertion, not the first in its set-up.

All traffic stays in the test's namespaces: the metadata address is the fake internet's own
(tests/net/net_fakes.py), never the host's.
"""

from __future__ import annotations

import pytest

from policy import load_policy
from policy.suggest import ALWAYS_DENIED
from tests.net.net_fakes import METADATA, reach
from tests.net.test_net_antispoof import iptables

ADMIT_METADATA = ("-t", "filter", "-I", "FORWARD", "1", "-d", f"{METADATA}/32", "-j", "ACCEPT")
SKIP_GUARD = ("-t", "raw", "-I", "PREROUTING", "1", "-d", f"{METADATA}/32", "-j", "ACCEPT")


@pytest.fixture
def admitting_guest(slot, guest) -> str:
    slot.apply_policy(load_policy("version: 1\nmode: audit\nallow: []\n", "p.yml"))
    iptables(slot, *ADMIT_METADATA)
    return guest


def test_the_metadata_address_is_reached_once_forward_admits_it_and_the_guard_is_skipped(
        slot, admitting_guest) -> None:
    iptables(slot, *SKIP_GUARD)
    assert reach(admitting_guest, METADATA, 80)


def test_the_guard_alone_refuses_the_metadata_address_and_logs_it_as_always_denied(slot, admitting_guest) -> None:
    assert not reach(admitting_guest, METADATA, 80)
    assert {(r.dest, r.port, r.reason) for r in slot.audit_records()} == {(METADATA, 80, ALWAYS_DENIED)}
