"""Who may create sandboxes is never the fleet's runner user (ATTACK.md finding 3): refused at config load
(the socket's refusal of a runner's uid is tests/service/test_vm_sdk.py's)."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.service.config import config_from_mapping

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
