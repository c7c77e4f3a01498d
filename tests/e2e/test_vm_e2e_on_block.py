"""`on_block: fail` and the operator's block list, end to end on networked real VMs (issue 18).

A `ServiceHost` (as `serve` runs it) on the fake internet of tests/e2e/fake_internet.py; the
repository's policy comes from the operator's store, the guest probes addresses and prints which
answered, and the job's final record says what happened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from runner.jobapi.client import JobClient
from runner.jobapi.contract import JobRecord
from runner.service.config.reading import config_from_mapping
from tests.e2e.fake_internet import ALLOWED_HOST, DENIED_HOST, PROBE, cidr_policy, fake_internet, probed, reached
from tests.e2e.vm_jobs import output, submit, templates, vm_root  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vm

ALLOWED = f"{ALLOWED_HOST}:8000"
DENIED = f"{DENIED_HOST}:8000"


@pytest.fixture
def store_host(need_netns: None, vm_root: Path, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """make(policy_text, **settings): a started networked ServiceHost whose store gives octo/hello that policy."""
    from runner.service.host.assembly import ServiceHost

    with ExitStack() as stack:
        internet = stack.enter_context(fake_internet())

        def make(policy: str, **settings: Any) -> ServiceHost:
            store = tmp_path / "policies"
            (store / "octo").mkdir(parents=True, exist_ok=True)
            (store / "octo" / "hello.yml").write_text(policy)
            config = config_from_mapping({"socket": str(vm_root / "api.sock"), "state_dir": str(vm_root / "state"),
                                          "shutdown_grace_seconds": 0, "policy_dir": str(store),
                                          "network": {**internet.network, **settings.pop("network", {})}, **settings})
            host = stack.enter_context(ServiceHost(config, engine=internet.engine(pool_size=0)))
            stack.callback(host.service.drain)
            return host

        yield make


def probe_job(host: Any, command_exit: int, *targets: str) -> tuple[JobRecord, str]:
    client = JobClient(socket=host.config.socket)
    job = submit(client, f"python3 probe.py {' '.join(targets)}; exit {command_exit}",
                 files={"probe.py": PROBE.encode()}, timeout_seconds=300)
    text = output(client, job).decode()
    assert probed(text) == set(targets), text
    return client.get(job), text


def test_on_block_fail_fails_a_job_whose_guest_was_refused_and_keeps_its_exit_code(store_host) -> None:
    host = store_host(cidr_policy(ALLOWED) + "on_block: fail\n")

    record, text = probe_job(host, 0, ALLOWED, DENIED)
    assert reached(text) == {ALLOWED}
    assert (record.state, record.exit_code) == ("failed", 0), record
    assert record.error is not None and "on_block: fail" in record.error and f"tcp {DENIED} (policy)" in record.error

    quiet, _ = probe_job(host, 3, ALLOWED)  # nothing refused: the job's own result stands
    assert (quiet.state, quiet.exit_code, quiet.error) == ("finished", 3, None)


def test_the_operators_block_list_is_refused_in_audit_mode_and_fails_an_on_block_fail_job(store_host,
                                                                                        tmp_path: Path) -> None:
    blocked = tmp_path / "blocked.txt"
    blocked.write_text(f"# the operator's feed\n{DENIED_HOST}/32\n")
    host = store_host(cidr_policy(mode="audit") + "on_block: fail\n", network={"block_list": str(blocked)})

    record, text = probe_job(host, 0, ALLOWED, DENIED)
    assert reached(text) == {ALLOWED}, text  # audit lets the policy's blocks through, never the block list
    reasons = {(entry.dest, entry.reason) for entry in record.blocked_egress}
    assert (DENIED_HOST, "block-listed") in reasons and (ALLOWED_HOST, "policy") in reasons
    assert (record.state, record.exit_code) == ("failed", 0), record  # only what audit mode refused counts
    assert record.error is not None and f"tcp {DENIED} (block-listed)" in record.error
    assert ALLOWED not in record.error
