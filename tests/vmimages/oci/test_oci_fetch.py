"""vmimages.oci.fetch: skopeo (confined) from a local layout and from Debian's docker-registry on 127.0.0.1,
then our own verification of the layout it wrote. Nothing here talks to anything but 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.errors import ImageError
from tests.conftest import require
from tests.vmimages.oci import images
from tests.vmimages.oci.images import Dir, File, Symlink, Whiteout, write_layout
from vmimages.oci import ImageLimits, apply_layers, fetch, parse_ref, verify_layout

LAYERS = [[Dir("bin"), File("bin/tool", b"#!/bin/sh\necho hi\n", 0o755), Symlink("bin/sh", "/bin/tool"),
           File("etc-motd", "old")],
          [Whiteout("etc-motd"), File("hello", "world")]]
CONFIG = dict(env=("PATH=/bin", "LANG=C.UTF-8"), workdir="/work", user="1000:1000")
quiet = [].append


@pytest.fixture(autouse=True)
def _tools() -> None:
    require(shutil.which("skopeo") is not None, "skopeo is not installed (Debian package skopeo)")
    require(os.geteuid() == 0, "not running as root (skopeo is run as uid 65534 from root)")


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A build directory uid 65534 may enter (pytest's tmp_path is under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="oci-fetch-test-", dir="/var/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def port(tmp_path: Path) -> Iterator[int]:
    require(os.path.exists("/usr/bin/docker-registry"), "docker-registry is not installed")
    with images.registry(tmp_path / "registry") as port:
        yield port


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): ("l:" + os.readlink(p) if p.is_symlink() else "d" if p.is_dir()
                                             else p.read_text()) for p in sorted(root.rglob("*"))}


def unpack(image, tmp_path: Path) -> dict[str, str]:
    (tmp_path / "private").mkdir(mode=0o700)
    root = tmp_path / "private" / "root"
    root.mkdir()
    apply_layers(image.layers, root, ImageLimits())
    return tree(root)


def test_a_local_layout_is_fetched_verified_and_applied(tmp_path, workdir) -> None:
    layout = write_layout(tmp_path / "img", LAYERS, **CONFIG)
    image = fetch(parse_ref(layout.ref), workdir, say=quiet)
    assert image.config.to_json() == {"env": ["PATH=/bin", "LANG=C.UTF-8"], "workdir": "/work", "user": "1000:1000"}
    assert [layer.digest for layer in image.layers] == list(layout.layer_digests)
    assert image.source_digest == ""
    assert unpack(image, tmp_path) == {"bin": "d", "bin/sh": "l:/bin/tool", "bin/tool": "#!/bin/sh\necho hi\n",
                                       "hello": "world"}
    # skopeo's output is root's and read-only before we read it; its home (and any credentials) is gone
    for path in (workdir / "fetch" / "layout").rglob("*"):
        info = path.lstat()
        assert info.st_uid == 0 and not info.st_mode & 0o222, path
    assert not (workdir / "fetch" / "home").exists()


def test_a_registry_tag_is_resolved_to_a_digest_and_the_digest_fetches_the_same(tmp_path, workdir, port) -> None:
    layout = write_layout(tmp_path / "img", LAYERS, **CONFIG)
    pushed = images.push(layout, port, "team/tool", "1")
    ref = parse_ref(pushed)
    image = fetch(ref, workdir, tls_verify=False, say=quiet)
    assert image.source_digest == layout.digest
    again = fetch(ref.pinned(image.source_digest), workdir, tls_verify=False, say=quiet)
    assert (again.manifest_digest, again.layers[0].digest) == (image.manifest_digest, image.layers[0].digest)
    assert unpack(again, tmp_path)["hello"] == "world"


def test_an_authfile_and_a_registries_conf_are_used_and_not_left_behind(tmp_path, workdir, port) -> None:
    layout = write_layout(tmp_path / "img", LAYERS)
    pushed = images.push(layout, port, "private", "1")
    (tmp_path / "auth.json").write_text(json.dumps({"auths": {f"127.0.0.1:{port}": {"auth": "dXNlcjpwYXNz"}}}))
    (tmp_path / "auth.json").chmod(0o600)
    (tmp_path / "registries.conf").write_text(f'[[registry]]\nlocation = "127.0.0.1:{port}"\ninsecure = true\n')
    image = fetch(parse_ref(pushed), workdir, authfile=tmp_path / "auth.json",
                  registries_conf=tmp_path / "registries.conf", say=quiet)  # TLS verified, but the conf says insecure
    assert image.source_digest == layout.digest
    assert not (workdir / "fetch" / "home").exists()
    assert not [p for p in workdir.rglob("*") if p.name in ("auth.json", "registries.conf")]


def test_an_index_gives_its_linux_amd64_image(tmp_path, workdir, port) -> None:
    layout = write_layout(tmp_path / "img", LAYERS, platforms=[("linux", "arm64"), ("linux", "amd64")], **CONFIG)
    image = fetch(parse_ref(images.push(layout, port, "multi", "1")), workdir, tls_verify=False, say=quiet)
    assert image.config.architecture == "amd64" and image.source_digest == layout.digest
    image = fetch(parse_ref(layout.ref), workdir, say=quiet)
    assert image.config.architecture == "amd64"


def test_a_manifest_list_without_linux_amd64_is_refused_naming_its_platforms(tmp_path, workdir, port) -> None:
    layout = write_layout(tmp_path / "img", LAYERS, platforms=[("linux", "arm64"), ("linux", "ppc64le")])
    for ref in (images.push(layout, port, "arm", "1"), layout.ref):
        with pytest.raises(ImageError, match=r"no linux/amd64 variant \(it has linux/arm64, linux/ppc64le\)"):
            fetch(parse_ref(ref), workdir, tls_verify=False, say=quiet)
        assert not (workdir / "fetch" / "layout").exists()  # refused before any layer was copied


def test_a_registry_blob_that_does_not_match_its_digest_is_refused_by_skopeo(tmp_path, workdir, port) -> None:
    layout = write_layout(tmp_path / "img", LAYERS)
    pushed = images.push(layout, port, "bad", "1")
    blob = images.registry_blob(tmp_path / "registry", layout.layer_digests[1])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ImageError, match="skopeo copy failed") as caught:
        fetch(parse_ref(pushed), workdir, tls_verify=False, say=quiet)
    assert layout.layer_digests[1].removeprefix("sha256:")[:12] in str(caught.value)


def test_a_local_blob_that_does_not_match_its_digest_is_refused(tmp_path, workdir) -> None:
    layout = write_layout(tmp_path / "img", LAYERS)
    blob = layout.blob(layout.layer_digests[0])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(ImageError, match=layout.layer_digests[0].removeprefix("sha256:")[:12]):
        fetch(parse_ref(layout.ref), workdir, say=quiet)


def test_our_verification_finds_a_blob_changed_after_skopeo(tmp_path, workdir) -> None:
    layout = write_layout(tmp_path / "img", LAYERS, **CONFIG)
    image = fetch(parse_ref(layout.ref), workdir, say=quiet)
    fetched = workdir / "fetch" / "layout"
    assert verify_layout(fetched).layers == image.layers
    blob = image.layers[1].path
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[-10] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(ImageError, match=f"blob {image.layers[1].digest} has sha256:"):
        verify_layout(fetched, what="test")
    blob.write_bytes(bytes(data[:-1]))
    with pytest.raises(ImageError, match=f"blob {image.layers[1].digest} is {len(data) - 1} bytes, its descriptor says"):
        verify_layout(fetched, what="test")


def test_layers_over_the_size_limits_are_refused_before_they_are_copied(tmp_path, workdir, port) -> None:
    layout = write_layout(tmp_path / "img", [[File("big", os.urandom(64 * 1024))]])
    pushed = images.push(layout, port, "big", "1")
    with pytest.raises(ImageError, match="over the 1024 allowed"):
        fetch(parse_ref(pushed), workdir, ImageLimits(max_compressed_bytes=1024), tls_verify=False, say=quiet)
    assert not (workdir / "fetch" / "layout").exists()
    with pytest.raises(ImageError, match="2 layers, over the 1 allowed"):
        fetch(parse_ref(images.push(write_layout(tmp_path / "two", LAYERS), port, "two", "1")), workdir,
              ImageLimits(max_layers=1), tls_verify=False, say=quiet)


def test_the_fetch_timeout_kills_skopeo(tmp_path, workdir) -> None:
    layout = write_layout(tmp_path / "img", LAYERS)
    with pytest.raises(ImageError, match="killed after 0.001 seconds"):
        fetch(parse_ref(layout.ref), workdir, ImageLimits(fetch_timeout_seconds=0.001), say=quiet)


def test_a_work_directory_skopeo_cannot_enter_is_refused_with_what_to_do(tmp_path) -> None:
    layout = write_layout(tmp_path / "img", LAYERS)
    (tmp_path / "closed").mkdir(mode=0o700)
    with pytest.raises(ImageError, match="skopeo runs as uid 65534 and cannot enter .* every user may enter"):
        fetch(parse_ref(layout.ref), tmp_path / "closed", say=quiet)


@pytest.mark.parametrize("change, says", [
    (lambda m: m["layers"][0].update(mediaType="application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"),
     "foreign or non-distributable"),
    (lambda m: m["layers"][0].update(urls=["http://203.0.113.1/x"]), "foreign or non-distributable"),
    (lambda m: m["layers"][0].update(mediaType="application/x-tar+bzip2"), "has media type"),
    (lambda m: m["config"].update(mediaType="application/octet-stream"), "not an image config"),
    (lambda m: m["layers"][0].update(digest="sha512:" + "0" * 128), "only sha256"),
    (lambda m: m["config"].update(size=5 * 1024**2), "over 4194304"),
])
def test_a_layout_with_refused_descriptors_is_refused(tmp_path, change, says) -> None:
    layout = write_layout(tmp_path / "img", LAYERS)
    index = json.loads((layout.path / "index.json").read_text())
    manifest = json.loads(layout.blob(layout.digest).read_text())
    change(manifest)
    raw = json.dumps(manifest).encode()
    digest = images._write_blob(layout.path, raw)
    index["manifests"][0].update(digest=digest, size=len(raw))
    (layout.path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ImageError, match=says):
        verify_layout(layout.path)


def test_a_layout_s_own_blob_must_be_a_regular_file(tmp_path) -> None:
    layout = write_layout(tmp_path / "img", LAYERS)
    blob = layout.blob(layout.layer_digests[0])
    blob.rename(tmp_path / "elsewhere")
    blob.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ImageError, match="cannot open"):
        verify_layout(layout.path)
    assert stat.S_ISLNK(blob.lstat().st_mode)


def test_a_local_file_that_grows_while_it_is_copied_is_cut_at_the_size_checked(tmp_path, monkeypatch):
    """The budget is charged the size fstat gave; a writer appending meanwhile cannot make the copy larger
    (stood in for by an fstat that reports less than the file has)."""
    import importlib
    import os as real_os
    from types import SimpleNamespace

    fetch_module = importlib.import_module("vmimages.oci.fetch")  # the module (the package exports its function)

    source = tmp_path / "blob"
    source.write_bytes(b"0123456789")
    reported = real_os.fstat

    def smaller(fd: int):  # type: ignore[no-untyped-def]
        info = reported(fd)
        return SimpleNamespace(st_mode=info.st_mode, st_size=4)

    monkeypatch.setattr(fetch_module.os, "fstat", smaller)
    budget = [100]
    fetch_module._copy_file(source, tmp_path / "copy", budget, "the test image")
    assert (tmp_path / "copy").read_bytes() == b"0123" and budget == [96]
