"""Review attacks on the fetch directory: skopeo (and zstd) run as uid 65534, and so may other processes on
the host. Whatever that uid can write, root must never reach by a path: a link planted there (raw.json,
source/, the layout itself) would make root write, chown or chmod a host file. As root, with skopeo."""

from __future__ import annotations

import importlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.errors import ImageError
from tests.conftest import require
from tests.vmimages.oci.images import Dir, File, write_layout
from vmimages.oci import confine, fetch, parse_ref

fetch_mod = importlib.import_module("vmimages.oci.fetch")  # the package's `fetch` is the function


@pytest.fixture(autouse=True)
def _tools() -> None:
    require(shutil.which("skopeo") is not None, "skopeo is not installed (Debian package skopeo)")
    require(os.geteuid() == 0, "not running as root (skopeo is run as uid 65534 from root)")


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="oci-attack-test-", dir="/var/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def host_file(tmp_path: Path) -> Path:
    """A root-owned 0600 file standing for /etc/shadow: its mode, owner and bytes must never change."""
    secret = tmp_path / "host" / "shadow"
    secret.parent.mkdir()
    secret.write_text("root:secret\n")
    secret.chmod(0o600)
    secret.parent.chmod(0o700)
    return secret


def as_nobody(*argv: str) -> int:
    """Run argv as uid/gid 65534 (as a compromised skopeo, or any other nobody process, would); its status."""
    return subprocess.run([*confine.as_unprivileged(), *argv], capture_output=True).returncode


def assert_untouched(host_file: Path) -> None:
    info = host_file.lstat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode), host_file.read_text()) == (0, 0o600, "root:secret\n")
    assert stat.S_IMODE(host_file.parent.lstat().st_mode) == 0o700  # its directory neither


def test_uid_65534_can_never_create_an_entry_where_root_writes_by_path(tmp_path, workdir, host_file) -> None:
    """Attack: a process running as nobody plants fetch/raw.json (root truncates and writes skopeo's output
    through it), fetch/source (root creates the local image's files through it, then chowns the link's
    target tree to nobody) or swaps fetch/layout for a link (root chmods its target 0444). Held when the
    fetch directory itself is root's: only home/ and layout/ are the helper's."""
    layout = write_layout(tmp_path / "img", [[Dir("etc"), File("etc/motd", "hi")]])
    tried: list[str] = []

    def say(_: str) -> None:
        base = workdir / "fetch"
        for name in ("raw.json.planted", "source.planted", "layout.planted"):
            tried.append(name)
            assert as_nobody("ln", "-s", str(host_file), str(base / name)) != 0, f"nobody could plant {name}"

    fetch(parse_ref(layout.ref), workdir, say=say)
    assert tried
    base = (workdir / "fetch").lstat()
    assert base.st_uid == 0 and not base.st_mode & 0o022
    assert_untouched(host_file)


def test_owning_the_layout_never_follows_a_link_put_in_its_place(tmp_path, host_file) -> None:
    """Attack: the layout directory is a link to a host directory when root makes skopeo's output its own:
    os.walk followed it and chmodded every file there 0444 (an /etc/shadow readable by all)."""
    layout = tmp_path / "layout"
    layout.symlink_to(host_file.parent)
    with pytest.raises(ImageError, match="layout"):
        fetch_mod._own(layout)
    assert_untouched(host_file)


def test_owning_the_layout_refuses_a_hard_link_to_a_host_file(tmp_path, host_file) -> None:
    """Attack: a hard link to a host file in skopeo's layout (same file system, or fs.protected_hardlinks off):
    root chmodded the host file 0444. Only files of the helper's with one link are taken."""
    layout = tmp_path / "layout"
    (layout / "blobs" / "sha256").mkdir(parents=True)
    os.link(host_file, layout / "blobs" / "sha256" / ("0" * 64))
    with pytest.raises(ImageError, match="0" * 64):
        fetch_mod._own(layout)
    assert_untouched(host_file)


def test_a_helper_output_file_that_is_a_planted_link_is_not_written_through(tmp_path, host_file) -> None:
    """Attack: the file skopeo's stdout goes to exists as a link to a host file: root opened it with
    O_TRUNC and wrote through it. It is created O_EXCL | O_NOFOLLOW now."""
    out = tmp_path / "raw.json"
    out.symlink_to(host_file)
    with pytest.raises(ImageError, match="raw.json"):
        confine.run(["/bin/echo", "pwned"], env=confine.minimal_env(tmp_path), cwd=tmp_path, timeout=10,
                    stdout=out, what="test")
    assert_untouched(host_file)


def test_local_sources_stay_roots_and_skopeo_still_reads_them(tmp_path, workdir) -> None:
    """The local layout's or archive's copy is root's (group-readable by the helper), not the helper's: an
    oci: layout and an oci-archive: both still fetch."""
    layout = write_layout(tmp_path / "img", [[Dir("etc"), File("etc/motd", "hi")]])
    archive = tmp_path / "img.tar"
    subprocess.run(["tar", "-C", str(layout.path), "-cf", str(archive), "."], check=True)
    seen: list[os.stat_result] = []
    for ref in (layout.ref, f"oci-archive:{archive}:{layout.tag}"):
        seen.clear()
        image = fetch(parse_ref(ref), workdir, say=lambda _: seen.append((workdir / "fetch" / "source").lstat()))
        assert [layer.digest for layer in image.layers] == list(layout.layer_digests)
        assert seen and all(s.st_uid == 0 and not s.st_mode & 0o027 for s in seen)
