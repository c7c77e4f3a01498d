"""The operator's block list (`policy.blocklist`): refused in every mode, audit included, recorded as
block-listed and never suggested (issue 18). Parsing first, then a slot on the fake internet."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from dnslib import RCODE

import tests.net.net_fakes as net_fakes
from policy import load_policy, suggest_policy
from policy.blocklist import BlockListError, load_block_list, parse_block_list
from policy.suggest import BLOCK_LISTED
from runner.net import NamespaceUplink, SlotPool, Upstream, netns
from tests.net.net_fakes import ALLOWED_HOST, DENIED_HOST, in_ns, lookup, reach

FEED = f"""\
# a malware feed
collector.evil.test        # the name and everything under it
*.tracker.test
{DENIED_HOST}/32
2001:db8:bad::/48
"""


def test_the_block_list_matches_names_below_it_and_its_networks() -> None:
    blocks = parse_block_list(FEED)
    assert blocks.blocks_name("collector.evil.test") and blocks.blocks_name("A.Collector.evil.test.")
    assert not blocks.blocks_name("evil.test") and not blocks.blocks_name("xcollector.evil.test")
    assert blocks.blocks_name("a.tracker.test") and not blocks.blocks_name("tracker.test")
    assert blocks.blocks_address(DENIED_HOST) and not blocks.blocks_address(ALLOWED_HOST)
    assert blocks.blocks_address("2001:db8:bad::1") and not blocks.blocks_address("2001:db8::1")


def test_bad_entries_are_reported_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "blocked.txt"
    path.write_text("ok.test\n10.0.0.300\nbad_label!.test\n*.*.x.test\n")
    with pytest.raises(BlockListError) as err:
        load_block_list(path)
    lines = str(err.value).splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == [f"{path}:2", f"{path}:3", f"{path}:4"]
    with pytest.raises(BlockListError, match="cannot read"):
        load_block_list(tmp_path / "missing.txt")


@pytest.fixture
def blocking_slot(need_netns) -> Iterator[tuple[object, str]]:
    prefix = "t" + secrets.token_hex(3)
    with ExitStack() as cleanup:
        internet, servers = net_fakes.build_internet(prefix)
        cleanup.callback(netns.remove, internet)
        cleanup.callback(netns.remove, f"{prefix}-guest")
        cleanup.callback(servers.close)
        pool = SlotPool(prefix, NamespaceUplink(internet), size=1, block_list=parse_block_list(FEED),
                        upstream=Upstream(net_fakes.UPSTREAM_DNS, netns=internet))
        cleanup.callback(pool.close)
        pool.start()
        slot = pool.acquire(job="blocked")
        yield slot, net_fakes.attach_guest(prefix, slot.netns)
    assert net_fakes.leftovers(prefix) == []


def test_audit_mode_still_refuses_what_the_block_list_names(blocking_slot) -> None:
    slot, guest = blocking_slot
    slot.apply_policy(load_policy('version: 1\nmode: audit\nallow:\n  - host: "*.cdn.test"\n    ports: [8000]\n'
                                  f"  - cidr: {DENIED_HOST}/32\n    ports: [8000]\n", "p.yml"))

    blocked_name = lookup(guest, "collector.evil.test")
    assert blocked_name is not None and blocked_name.header.rcode == RCODE.NXDOMAIN
    assert not reach(guest, DENIED_HOST, 8000)  # allowed by a cidr rule, audit mode: blocked all the same
    assert lookup(guest, "a.cdn.test") is not None

    def hello_for(name: str) -> bytes:
        import socket

        with socket.create_connection((ALLOWED_HOST, 8000), timeout=3) as sock:
            sock.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
            try:
                return sock.recv(100)
            except OSError:
                return b""

    assert in_ns(guest, lambda: hello_for("a.cdn.test")) == f"{ALLOWED_HOST}:8000".encode()
    assert in_ns(guest, lambda: hello_for("x.tracker.test")) == b""  # audit lets wrong names through, never these
    records = [r for r in slot.audit_records() if r.reason == BLOCK_LISTED]
    assert {(r.dest, r.name) for r in records} >= {("name block-listed", "collector.evil.test"),
                                                   (DENIED_HOST, None), (ALLOWED_HOST, "x.tracker.test")}
    suggestion = suggest_policy([r for r in (r.checked() for r in slot.audit_records()) if r])
    allowed = load_policy(suggestion, "s.yml")
    assert not any(rule.host in ("collector.evil.test", "x.tracker.test") for rule in allowed.rules), suggestion
    assert "on the operator's block list" in suggestion
