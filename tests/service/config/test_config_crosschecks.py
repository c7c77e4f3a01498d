"""Cross-checks at config load from ATTACK.md: who may create sandboxes is never the fleet's runner user
(finding 3; the socket's refusal of a runner's uid is tests/e2e/test_vm_sdk.py's), and size classes
fit the host's memory (finding 7)."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.service.config.checks import HOST_RESERVE_MIB
from runner.service.config.reading import config_from_mapping

# `daemon` (uid 1, primary group `daemon`) is on every Debian host: it plays the runners' user here
FLEET = {"runners": {"org": "example", "runner_user": "daemon", "github_config": "/etc/microvm-check/app.yml"}}


def test_the_socket_group_is_refused_as_the_sandboxes_group() -> None:
    with pytest.raises(ConfigError, match=r"sandboxes\.group: is socket_group \('?mvc'?\).*runners' user"):
        config_from_mapping({"socket_group": "mvc", "sandboxes": {"group": "mvc"}})


def test_a_group_holding_the_runners_user_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"sandboxes\.group: group '?daemon'? holds the runners' user '?daemon'?"):
        config_from_mapping({**FLEET, "sandboxes": {"group": "daemon"}})
    config_from_mapping({**FLEET, "sandboxes": {"group": "root"}})  # a group without it loads
    config_from_mapping({"runners": {"runner_user": "daemon"}, "sandboxes": {"group": "daemon"}})  # no fleet: no runners


def test_sizes_that_cannot_run_max_concurrent_jobs_in_the_hosts_memory_are_refused() -> None:
    """ATTACK.md finding 7: max_concurrent_jobs VMs of the largest class (memory_mib + QEMU's 512 MiB)
    must fit in MemTotal less the host's reserve."""
    from runner.vm.memory import host_memory_mib

    host = host_memory_mib()
    assert host is not None
    fits = (host - HOST_RESERVE_MIB) // 2 - 512  # two VMs of it, each with QEMU's own 512 MiB
    config_from_mapping({"max_concurrent_jobs": 2, "sizes": {"small": {"memory_mib": 512},
                                                             "big": {"memory_mib": fits}}})
    with pytest.raises(ConfigError, match=r"sizes\.big: max_concurrent_jobs \(3\) VMs of this size need .* "
                                          r"max_concurrent_jobs to 2 or fewer"):
        config_from_mapping({"max_concurrent_jobs": 3, "sizes": {"small": {"memory_mib": 512},
                                                                 "big": {"memory_mib": fits}}})
