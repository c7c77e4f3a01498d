"""`runner install --from` verifies and unpacks the same bytes: a file renamed over the path after its
digest was taken never becomes the release every later runner starts from."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from runner.fleet import install
from tests.fleet.conftest import RUN_SH, VERSION, standin_tarball


def _evil_tarball(path: Path) -> None:
    with tarfile.open(path, "w:gz") as archive:
        data = b"#!/bin/sh\necho evil-release\n"
        info = tarfile.TarInfo("./run.sh")
        info.size, info.mode = len(data), 0o755
        archive.addfile(info, io.BytesIO(data))


def test_a_from_file_swapped_after_its_digest_is_never_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.cli import main

    tarball, digest = standin_tarball(tmp_path)
    evil = tmp_path / "evil.tar.gz"
    _evil_tarball(evil)
    evil_bytes = evil.read_bytes()
    config = tmp_path / "service.yml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"),
                                      "runners": {"install_dir": str(tmp_path / "release")}}))
    swapped = []

    class Swapping:
        """hashlib.sha256 whose digest, once taken, renames the attacker's file over the path."""

        def __init__(self) -> None:
            self._real = hashlib.sha256()

        def update(self, data: bytes) -> None:
            self._real.update(data)

        def hexdigest(self) -> str:
            os.rename(evil, tarball)
            swapped.append(True)
            return self._real.hexdigest()

    monkeypatch.setattr(install, "hashlib", SimpleNamespace(sha256=Swapping))
    code = main(["runner", "install", "--version", VERSION, "--from", str(tarball), "--sha256", digest,
                 "--service-config", str(config)])
    assert swapped and tarball.read_bytes() == evil_bytes  # the path now names the attacker's file
    run_sh = tmp_path / "release" / "current" / "run.sh"
    assert code == 0 and run_sh.read_text() == RUN_SH  # what was verified is what was installed
