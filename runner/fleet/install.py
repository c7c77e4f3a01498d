"""`microvm-check runner install`: the official actions/runner release, verified, unpacked once, read-only.

Runners never run from this copy: each gets a fresh copy of its own (`runner.fleet.workdir`), so a job
can change nothing here and nothing of a job survives in it. It is owned by root and has no write bits
for anyone else. No checksum table is shipped: actions/runner's release notes in its repository hold
placeholders, not digests, so the digest must come from the release page the operator trusts.
"""

from __future__ import annotations

import gzip
import hashlib
import hmac
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, cast

from runner.errors import ConfigError
from runner.tarsafe import Limits, UnsafeTar, extract

ASSET = "actions-runner-linux-x64-{version}.tar.gz"
RELEASE_URL = "https://github.com/actions/runner/releases/download/v{version}/" + ASSET
VERSION_RE = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}\.[0-9]{1,4}")
SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")
CURRENT = "current"
MAX_DOWNLOAD = 1024**3
# The release is large (two Node.js runtimes with npm): room for it, still a bound.
RELEASE_LIMITS = Limits(max_files=60_000, max_file_bytes=1024**3, max_total_bytes=4 * 1024**3)


class InstallError(ConfigError):
    """The runner could not be installed; the message says what to do."""


@dataclass(frozen=True)
class InstalledRelease:
    version: str
    path: Path


def check_version(version: str) -> str:
    if not VERSION_RE.fullmatch(version):
        raise InstallError(f"--version must look like 2.336.0, not {version[:40]!r}")
    return version


def private_copy(tarball: Path, scratch: Path) -> tuple[BinaryIO, str]:
    """The bytes of `tarball`, read once through one descriptor into an unnamed file of root's in
    `scratch` (nobody else can open, rename over or change it), and their SHA-256. Everything after
    (the check, the unpacking) reads this copy, so what was verified is what is installed, even if
    the path is renamed over or the file rewritten meanwhile."""
    try:
        fd = os.open(tarball, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise InstallError(f"cannot open {tarball}: {exc}") from exc
    copy = tempfile.TemporaryFile(dir=scratch)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
                copy.write(chunk)
                if copy.tell() > MAX_DOWNLOAD:
                    raise InstallError(f"{tarball} is larger than {MAX_DOWNLOAD} bytes: not a runner release")
        copy.flush()
        copy.seek(0)
    except BaseException:
        copy.close()
        raise
    return copy, digest.hexdigest()


def verify(actual: str, sha256: str, tarball: Path) -> None:
    """Refuse bytes whose digest is not the expected one."""
    if not hmac.compare_digest(actual, sha256.lower()):
        raise InstallError(f"{tarball} has sha256 {actual}, not the expected {sha256.lower()}: "
                           "it is not the release you meant (or the download broke); nothing was installed")


def _check_sha256(sha256: str) -> None:
    if not SHA256_RE.fullmatch(sha256):
        raise InstallError(f"--sha256 must be 64 hexadecimal digits, not {sha256[:80]!r}")


def download(version: str, directory: Path) -> Path:
    """The release tarball from GitHub into `directory`, bounded in size; its digest is checked after."""
    import requests

    url = RELEASE_URL.format(version=version)
    target = directory / ASSET.format(version=version)
    try:
        with requests.get(url, stream=True, timeout=60) as response:
            response.raise_for_status()
            written = 0
            with open(target, "wb") as out:
                for chunk in response.iter_content(1 << 20):
                    written += len(chunk)
                    if written > MAX_DOWNLOAD:
                        raise InstallError(f"{url} is larger than {MAX_DOWNLOAD} bytes: not a runner release")
                    out.write(chunk)
    except requests.RequestException as exc:
        raise InstallError(f"cannot download {url} ({exc}): on a host without internet access, fetch it "
                           "elsewhere and pass --from FILE") from exc
    return target


def install(tarball: Path, version: str, sha256: str, install_dir: Path) -> InstalledRelease:
    """Verify, unpack into `install_dir/<version>`, make it read-only and point `current` at it."""
    check_version(version)
    _check_sha256(sha256)
    install_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    copy, actual = private_copy(tarball, install_dir)
    with copy:
        verify(actual, sha256, tarball)
        return _install_verified(copy, tarball, version, install_dir)


def _install_verified(copy: BinaryIO, tarball: Path, version: str, install_dir: Path) -> InstalledRelease:
    final = install_dir / version
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=install_dir))
    try:
        _unpack(copy, tarball, staging)
        if not (staging / "run.sh").is_file():
            raise InstallError(f"{tarball} has no run.sh at its top: not an actions/runner release")
        _read_only(staging)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    link = install_dir / f".{CURRENT}.tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(version)
    link.replace(install_dir / CURRENT)
    return InstalledRelease(version, final)


def current(install_dir: Path) -> Path:
    """The installed release runners are copied from; an error saying how to install one otherwise."""
    release = (install_dir / CURRENT).resolve()
    if not (release / "run.sh").is_file():
        raise InstallError(f"no runner release is installed in {install_dir}: run "
                           "`microvm-check runner install --version V --sha256 H` (or --from FILE) first")
    return release


def _unpack(copy: BinaryIO, tarball: Path, dest: Path) -> None:
    """Regular files and directories through the safe extractor; then the release's own relative
    symbolic links (Node's `npm` and `npx`), each only if it stays inside the release. Both passes
    read the verified private copy (`private_copy`), never the path again."""
    try:
        copy.seek(0)
        with gzip.GzipFile(fileobj=copy, mode="rb") as stream:
            # a GzipFile reads like any binary file but is not nominally a BinaryIO; extract only reads it
            result = extract(cast(BinaryIO, stream), dest, RELEASE_LIMITS)
        copy.seek(0)
        with tarfile.open(fileobj=copy, mode="r:gz") as archive:
            links = {m.name.lstrip("./"): m.linkname for m in archive if m.issym()}
    except (UnsafeTar, OSError, EOFError, tarfile.TarError) as exc:
        raise InstallError(f"{tarball}: {exc}") from exc
    problems = [f"{name}: {why}" for name, why in result.skipped if name.lstrip("./") not in links]
    if problems:
        raise InstallError(f"{tarball} holds entries a runner release does not: {'; '.join(problems[:5])}")
    for name, target in links.items():
        _link_inside(dest, name, target)


def _link_inside(dest: Path, name: str, target: str) -> None:
    where = PurePosixPath(name)
    resolved = os.path.normpath(os.path.join(str(where.parent), target))
    if os.path.isabs(target) or resolved.startswith("..") or ".." in where.parts:
        raise InstallError(f"the release's link {name} -> {target} points outside it")
    path = dest / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def _read_only(root: Path) -> None:
    """root:root, 0755 directories and programs, 0644 other files: runners read it, nobody writes it."""
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = os.path.join(directory, name)
            os.lchown(path, 0, 0)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                os.chmod(path, 0o755 if (mode & 0o111 or os.path.isdir(path)) else 0o644)
    os.chown(root, 0, 0)
    os.chmod(root, 0o755)
