"""Packing the checkout: hostile trees, credentials in .git, streaming."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from runner.jobapi.pack import PackError, pack_checkout, strip_credentials

TOKEN = "ghs_SuperSecretToken1234567890"


def members(root: Path, **kwargs) -> dict[str, tarfile.TarInfo | bytes]:
    data = b"".join(pack_checkout(root, **kwargs))
    out: dict[str, tarfile.TarInfo | bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for member in archive:
            out[member.name] = archive.extractfile(member).read() if member.isfile() else member
    return out


def git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={"PATH": os.environ["PATH"], "HOME": str(cwd), "GIT_CONFIG_NOSYSTEM": "1"})


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "link-inside").symlink_to("src/pkg/mod.py")
    (root / "src" / "up").symlink_to("../run.sh")
    return root


@pytest.fixture
def with_git(checkout: Path) -> Path:
    git(checkout, "init", "-q", "-b", "main")
    git(checkout, "add", ".")
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "init")
    # What actions/checkout leaves behind with persist-credentials, plus worse.
    git(checkout, "config", "http.https://github.com/.extraheader", f"AUTHORIZATION: basic {TOKEN}")
    git(checkout, "remote", "add", "origin", f"https://x-access-token:{TOKEN}@github.com/o/r.git?t={TOKEN}")
    git(checkout, "remote", "add", "fork", "git@github.com:someone/r.git")
    git(checkout, "config", "credential.helper", f"store --file /home/runner/{TOKEN}")
    git(checkout, "config", "core.sshCommand", "ssh -i /home/runner/.ssh/id_rsa")
    hook = checkout / ".git" / "hooks" / "post-checkout"
    hook.write_text("#!/bin/sh\ncurl evil\n")
    (checkout / ".git" / "FETCH_HEAD").write_text(f"abc https://{TOKEN}@github.com/o/r\n")
    return checkout


def test_regular_tree_with_inside_links(checkout: Path) -> None:
    got = members(checkout)
    assert got["src/pkg/mod.py"] == b"print('hi')\n"
    assert got["run.sh"] == b"#!/bin/sh\n"
    assert got["link-inside"].linkname == "src/pkg/mod.py"
    assert got["src/up"].linkname == "../run.sh"
    assert got["src"].isdir()
    info = next(m for m in tarfile.open(fileobj=io.BytesIO(b"".join(pack_checkout(checkout)))) if m.name == "run.sh")
    assert info.mode == 0o755 and info.uid == 0 and info.uname == ""


@pytest.mark.parametrize("target", ["/etc/passwd", "../../../outside", "../../src/../../x", "/"])
def test_link_pointing_outside_is_refused_by_name(checkout: Path, target: str) -> None:
    (checkout / "src" / "pkg" / "evil").symlink_to(target)
    with pytest.raises(PackError, match="src/pkg/evil"):
        pack_checkout(checkout)


def test_link_escaping_through_another_link_is_refused(checkout: Path) -> None:
    # `here -> .` is harmless, but `here/..` is the checkout's parent: lexical checks miss this.
    (checkout / "here").symlink_to(".")
    (checkout / "sneaky").symlink_to("here/../repo/run.sh")
    with pytest.raises(PackError, match="sneaky"):
        pack_checkout(checkout)


def test_link_to_a_directory_link_loop_is_refused(checkout: Path) -> None:
    (checkout / "loop1").symlink_to("loop2")
    (checkout / "loop2").symlink_to("loop1")
    with pytest.raises(PackError, match="loop"):
        pack_checkout(checkout)


def test_absolute_link_inside_the_checkout_becomes_relative(checkout: Path) -> None:
    (checkout / "src" / "abs").symlink_to(checkout / "run.sh")
    assert members(checkout)["src/abs"].linkname == "../run.sh"


def test_directory_symlink_is_not_descended(checkout: Path, tmp_path: Path) -> None:
    (checkout / "dirlink").symlink_to("src")
    got = members(checkout)
    assert got["dirlink"].issym() and not any(name.startswith("dirlink/") for name in got)


def test_fifo_is_skipped(checkout: Path) -> None:
    os.mkfifo(checkout / "pipe")
    assert "pipe" not in members(checkout)


def test_no_git_by_default_at_any_depth(with_git: Path) -> None:
    nested = with_git / "sub" / ".git"
    nested.mkdir(parents=True)
    (nested / "config").write_text(f"[http]\n\textraheader = {TOKEN}\n")
    (with_git / "vendored").mkdir()
    (with_git / "vendored" / ".git").write_text("gitdir: /home/runner/elsewhere\n")
    got = members(with_git)
    assert not any(part == ".git" for name in got for part in name.split("/"))
    assert "sub" in got and "src/pkg/mod.py" in got


def test_sanitised_git_keeps_history_and_drops_credentials(with_git: Path, tmp_path: Path) -> None:
    data = b"".join(pack_checkout(with_git, include_git=True))
    assert TOKEN.encode() not in data
    assert b"id_rsa" not in data and b"curl evil" not in data
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        names = archive.getnames()
        assert not any(n.startswith(".git/hooks") or n.startswith(".git/logs") for n in names)
        assert ".git/FETCH_HEAD" not in names
        assert all(m.isfile() or m.isdir() for m in archive.getmembers() if m.name.startswith(".git"))
        unpacked = tmp_path / "unpacked"
        archive.extractall(unpacked)  # our own tar, read back
    config = (unpacked / ".git" / "config").read_text()
    assert "https://github.com/o/r.git" in config and "git@github.com:someone/r.git" in config
    assert "extraheader" not in config and "credential" not in config and "sshCommand" not in config
    log = subprocess.run(["git", "log", "--oneline"], cwd=unpacked, capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1"})
    assert "init" in log.stdout
    status = subprocess.run(["git", "status", "--porcelain"], cwd=unpacked, capture_output=True, text=True,
                            check=True, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path),
                                             "GIT_CONFIG_NOSYSTEM": "1"})
    assert status.stdout == ""


def test_include_git_refuses_a_gitdir_file(checkout: Path) -> None:
    (checkout / ".git").write_text("gitdir: /home/runner/work/_temp/x\n")
    with pytest.raises(PackError, match="plain .git directory"):
        pack_checkout(checkout, include_git=True)


def test_alternates_are_not_shipped(with_git: Path) -> None:
    (with_git / ".git" / "objects" / "info").mkdir(exist_ok=True)
    (with_git / ".git" / "objects" / "info" / "alternates").write_text("/home/runner/cache/objects\n")
    assert ".git/objects/info/alternates" not in members(with_git, include_git=True)


@pytest.mark.parametrize("url,expected", [
    (f"https://x-access-token:{TOKEN}@github.com/o/r.git", "https://github.com/o/r.git"),
    (f"https://{TOKEN}@github.com:8443/o/r?token={TOKEN}#frag", "https://github.com:8443/o/r"),
    ("git@github.com:o/r.git", "git@github.com:o/r.git"),
    (f"ssh://git:{TOKEN}@[::1]:22/o/r", "ssh://[::1]:22/o/r"),
    ("/srv/mirror/r.git", "/srv/mirror/r.git"),
])
def test_strip_credentials(url: str, expected: str) -> None:
    assert strip_credentials(url) == expected


def test_stream_is_lazy_and_chunked(tmp_path: Path) -> None:
    root = tmp_path / "big"
    root.mkdir()
    with (root / "big.bin").open("wb") as handle:
        handle.truncate(8 * 1024 * 1024)
    stream = pack_checkout(root)
    sizes = [len(chunk) for chunk in stream]
    assert max(sizes) <= 256 * 1024
    assert sum(sizes) >= 8 * 1024 * 1024


def test_file_shrinking_while_packing_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "shrink"
    root.mkdir()
    (root / "f").write_bytes(b"x" * 1_000_000)
    stream = pack_checkout(root)
    next(stream)  # the header with the size is out; now the file changes under us
    (root / "f").write_bytes(b"x")
    with pytest.raises(PackError, match="shrank"):
        list(stream)


def test_host_git_ignores_the_workspace_and_ambient_git_settings(with_git: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Git run for a job's checkout takes nothing from the caller's cwd or GIT_* variables."""
    from runner.commands.localrun import _head

    marker = tmp_path / "fsmonitor-ran"
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    monkeypatch.chdir(other)
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS", f"'core.fsmonitor'='touch {marker}'")
    expected = subprocess.run(["git", "rev-parse", "HEAD"], cwd=with_git, capture_output=True, text=True,
                              env={"PATH": os.environ["PATH"]}).stdout.strip()
    assert _head(with_git) == expected
    data = b"".join(pack_checkout(with_git, include_git=True))
    assert data
    assert not marker.exists()


def test_a_runs_commit_is_read_in_a_subdirectory_of_a_work_tree_and_zeros_outside_one(with_git: Path,
                                                                                      tmp_path: Path) -> None:
    from runner.commands.localrun import _head

    sub = with_git / "sub"
    sub.mkdir()
    assert _head(sub) == _head(with_git) != "0" * 40  # git finds the work tree above, as `run --dir sub` sends
    plain = tmp_path / "plain"
    plain.mkdir()
    if not any((d / ".git").exists() for d in plain.parents):  # the test's own tmp dir lies in no work tree
        assert _head(plain) == "0" * 40
