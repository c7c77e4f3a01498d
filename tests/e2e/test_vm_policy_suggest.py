"""`policy suggest` on real VMs: three audited jobs of one repository, each needing a different host and
port of a fake internet, give one suggested policy under which all three pass in block mode, and which
allows no always-denied destination although every job also tried the metadata service.

The jobs run through a networked `ServiceHost` (as `serve` runs them); the suggestion is read from its
SQLite job records by the real CLI. Needs root, QEMU, network namespaces and the built `base` template:
failing under CI=true.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from policy import load_policy
from runner.cli import main
from runner.jobapi.client import JobClient
from tests.e2e.fake_internet import ALLOWED_HOST, DENIED_HOST, METADATA
from tests.e2e.test_vm_e2e_network import net_host  # noqa: F401 (fixture)
from tests.e2e.vm_jobs import output, submit, templates, vm_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vm

REPOSITORY = "octo/shards"
# What each job needs, by name (the resolver hands out the address, audit records carry the name).
NEEDS = {"web.test:8000": ALLOWED_HOST, "a.cdn.test:9000": ALLOWED_HOST, "denied.test:8000": DENIED_HOST}
# The job dials its names, then the metadata service by address; it fails unless every name answered as itself.
PROBE = textwrap.dedent(
    """
    import socket, sys
    def banner(host, port):
        try:
            with socket.create_connection((host, port), timeout=3) as s:
                s.settimeout(3)
                return s.recv(100).decode("ascii", "replace")
        except OSError:
            return ""
    failed = False
    for target in sys.argv[1:]:
        name, port = target.rsplit(":", 1)
        try:
            address = socket.gethostbyname(name)
        except OSError:
            address = "nxdomain"
        ok = banner(address, int(port)) == f"{address}:{port}"
        failed |= not ok
        print("open" if ok else "closed", target, address, flush=True)
    print("metadata", "open" if banner("%s", 80) else "closed", flush=True)
    sys.exit(1 if failed else 0)
    """ % METADATA
)


def run_jobs(client: JobClient) -> dict[str, tuple[Any, str]]:
    """Each need as its own job of the repository, submitted together; final record and output of each."""
    jobs = {need: submit(client, f"python3 probe.py {need}", files={"probe.py": PROBE.encode()},
                         repository=REPOSITORY, timeout_seconds=300) for need in NEEDS}
    texts = {need: output(client, job).decode() for need, job in jobs.items()}  # follows each log to its end
    return {need: (client.get(job), texts[need]) for need, job in jobs.items()}


def test_one_suggested_policy_from_three_audited_jobs_lets_all_three_pass_in_block_mode(
        net_host, vm_root: Path, tmp_path: Path, capsys) -> None:
    store = tmp_path / "policies"
    (store / "octo").mkdir(parents=True)
    repository_policy = store / "octo" / "shards.yml"
    repository_policy.write_text("version: 1\nmode: audit\nallow: []\n")
    host = net_host(policy_dir=str(store))
    client = JobClient(socket=host.config.socket)

    audited = run_jobs(client)

    for need, (record, text) in audited.items():
        assert (record.state, record.exit_code) == ("finished", 0), (need, record, text)
        assert "metadata closed" in text, text  # always denied, audit mode or not
        tried = {(b.name, b.port, b.reason) for b in record.blocked_egress}
        assert (need.split(":")[0], int(need.split(":")[1]), "policy") in tried, tried
        # the server speaks first and the job sends nothing: the record says it named nothing
        assert any(b.name == need.split(":")[0] and b.unnamed is True for b in record.blocked_egress), record
        assert (None, 80, "always-denied") in tried, tried

    assert main(["policy", "suggest", "--repository", REPOSITORY, "--state-dir", str(vm_root / "state")]) == 0
    suggestion = capsys.readouterr().out
    suggested = load_policy(suggestion, "suggested.yml")
    assert suggested.mode == "block"
    assert sorted((rule.host, sorted(rule.ports), rule.raw) for rule in suggested.rules) == [
        ("a.cdn.test", [9000], True), ("denied.test", [8000], True), ("web.test", [8000], True)]
    assert "so the entry is raw: enforced by address only" in suggestion
    assert not suggested.allows(80, "tcp", address=METADATA)
    assert "# always denied, no policy can allow it, was attempted: tcp to 169.254.169.254 port 80 " \
           "(seen in 3 of 3 jobs" in suggestion

    repository_policy.write_text(suggestion)  # the operator adopts it
    blocking = run_jobs(client)

    for need, (record, text) in blocking.items():
        assert (record.state, record.exit_code) == ("finished", 0), (need, record, text)
        assert record.policy_digest == suggested.digest()
        assert f"open {need} {NEEDS[need]}" in text and "metadata closed" in text, text
        assert [(b.port, b.reason) for b in record.blocked_egress] == [(80, "always-denied")], record
