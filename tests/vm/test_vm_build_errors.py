"""Template build steps fail with BuildError (shown by `template build` as a message), never a traceback."""

from __future__ import annotations

import pytest

from vmimages import bake, kernel
from vmimages.run import BuildError


@pytest.fixture
def failing_apt(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "apt-get": "echo 'E: Unable to locate package' >&2; exit 100",  # download fails
        "apt-cache": "exit 0",  # depends answers, but names no package
    }
    for tool, body in scripts.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_a_failed_kernel_download_is_a_build_error(failing_apt, tmp_path):
    with pytest.raises(BuildError, match="apt-get failed"):
        kernel.fetch("linux-image-0.0.0-none", tmp_path / "cache")


def test_an_unresolvable_kernel_package_is_a_build_error(failing_apt):
    with pytest.raises(BuildError, match="cannot resolve"):
        kernel.resolve_package("linux-image-none")


def test_a_failed_disk_copy_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match="cp failed"):
        bake.bake(None, None, tmp_path / "missing.img", tmp_path / "variant", (), print)
