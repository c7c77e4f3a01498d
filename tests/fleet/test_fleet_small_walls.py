"""The smaller holes of issue 16: a runner's `.env` is 0600 from its creation, and `/v1/health` shows the
host's counts (every repository's activity) to the operator only."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from runner.fleet import workdir
from tests.fleet.conftest import Account
from tests.fleet.test_fleet_access import probe


class _Watching:
    """`os` for runner.fleet.workdir, noting the mode of `watched` at every call the module makes."""

    def __init__(self, watched: Path, seen: list[int]) -> None:
        self._watched, self._seen = watched, seen

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if not callable(real):
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            result = real(*args, **kwargs)
            try:
                self._seen.append(stat.S_IMODE(os.lstat(self._watched).st_mode))
            except FileNotFoundError:
                pass
            return result
        return call


def test_a_runners_env_is_never_readable_by_others(tmp_path: Path, monkeypatch) -> None:
    release = tmp_path / "release"
    release.mkdir()
    (release / "run.sh").write_text("#!/bin/sh\n")
    path = tmp_path / "runner"
    seen: list[int] = []
    monkeypatch.setattr(workdir, "os", _Watching(path / ".env", seen))
    old = os.umask(0)  # the service's umask must not decide: with 0, a file made the plain way is 0666
    try:
        workdir.make(release, path, SimpleNamespace(uid=4242, gid=4242), "mvc-x", "the-token", {})
    finally:
        os.umask(old)
    assert seen and set(seen) == {0o600}, [oct(mode) for mode in seen]
    assert (path / ".env").stat().st_uid == 4242 and "the-token" in (path / ".env").read_text()


def test_health_counts_are_the_operators_only(account: Account, rig_root: Path) -> None:
    import yaml

    from runner.jobapi.client import JobClient
    from runner.service.config.reading import load_config
    from runner.service.host.assembly import ServiceHost

    path = rig_root / "service.yml"
    socket = rig_root / "api.sock"
    path.write_text(yaml.safe_dump({"socket": str(socket), "socket_group": account.group,
                                    "state_dir": str(rig_root / "state"), "local_jobs": {"repository": "local/jobs"}}))
    with ServiceHost(load_config(path), sandboxes=_no_vms, origin=str(path)):
        member = probe(account, socket, [["health"]])[0]["health"]
        with JobClient(socket=str(socket)) as client:  # root: the operator
            operator = client.health()
    assert member == {"ok": True, "accel": None, "running": None, "queued": None, "warm": None}
    assert operator.ok and (operator.running, operator.queued, operator.warm) == (0, 0, 0)


def _no_vms(request: Any) -> Any:
    raise AssertionError("no job here gets a checkout: no VM may be created")
