"""vmimages.oci.layers: hostile layers are refused and write nothing outside the root; good ones give the
exact tree (whiteouts, opaque directories, replacements, owners and set-id modes). As root (owners)."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from runner.errors import ImageError, TemplateError
from tests.conftest import require
from tests.vmimages.oci.images import (
    Device,
    Dir,
    Fifo,
    File,
    Hardlink,
    Opaque,
    Symlink,
    Whiteout,
    layer_tar,
    write_layout,
)
from vmimages.oci import ImageLimits, Layer, apply_layers, verify_layout

SMALL = ImageLimits(max_files=100, max_uncompressed_bytes=8 * 1024**2, max_file_bytes=4 * 1024**2)


@pytest.fixture(autouse=True)
def _root() -> None:
    require(os.geteuid() == 0, "not running as root (the applier keeps the image's owners)")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "root").mkdir()
    return private / "root"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A sentinel directory beside the private one: nothing may ever appear in it."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("host file")
    return tmp_path / "outside"


def layers_of(tmp_path: Path, *layers, compression: str = "gzip", media_type: str = "") -> tuple[Layer, ...]:
    layout = write_layout(tmp_path / f"layout-{len(list(tmp_path.glob('layout-*')))}", list(layers),
                          compression=compression, raw_media_type=media_type)
    return verify_layout(layout.path).layers


def apply(tmp_path: Path, root: Path, *layers, limits: ImageLimits = SMALL, **kw) -> None:
    apply_layers(layers_of(tmp_path, *layers, **kw), root, limits)


def tree(root: Path) -> dict[str, str]:
    """Every entry under root: 'd' directories, 'l:target' links, file contents."""
    out = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[name] = "l:" + os.readlink(path)
        elif path.is_dir():
            out[name] = "d"
        else:
            out[name] = path.read_text()
    return out


def assert_untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_text() == "host file"


def test_the_error_is_a_template_error() -> None:
    assert issubclass(ImageError, TemplateError)


@pytest.mark.parametrize("name", ["../evil", "a/../../evil", "./../evil", "/abs/evil", "a/\x01b"])
def test_names_outside_the_root_or_with_control_characters_are_refused(tmp_path, root, outside, name) -> None:
    with pytest.raises(ImageError, match=r"layer 1 \(sha256:[0-9a-f]{64}\): member") as caught:
        apply(tmp_path, root, [File("ok", b"fine"), File(name, b"evil")])
    assert "'..'" in str(caught.value) or "absolute" in str(caught.value) or "control" in str(caught.value)
    assert not (tmp_path / "evil").exists()
    assert_untouched(outside)


def test_a_file_through_an_absolute_symlink_is_refused_and_nothing_is_written_outside(tmp_path, root, outside) -> None:
    with pytest.raises(ImageError, match="member 'escape/pwned' goes through the link 'escape'"):
        apply(tmp_path, root, [Symlink("escape", str(outside))], [File("escape/pwned", b"x")])
    assert_untouched(outside)
    assert os.readlink(root / "escape") == str(outside)  # the link itself is the image's, never followed


def test_a_directory_or_file_through_a_relative_symlink_in_the_same_layer_is_refused(tmp_path, root, outside) -> None:
    hop = os.path.relpath(outside, root / "a")
    with pytest.raises(ImageError, match="goes through the link 'a/up'"):
        apply(tmp_path, root, [Dir("a"), Symlink("a/up", hop), Dir("a/up/newdir")])
    assert_untouched(outside)


def test_absolute_symlinks_are_created_as_they_are(tmp_path, root) -> None:
    apply(tmp_path, root, [Dir("bin"), Symlink("bin/sh", "/bin/busybox"), Symlink("lib", "usr/lib")])
    assert os.readlink(root / "bin" / "sh") == "/bin/busybox"
    assert os.readlink(root / "lib") == "usr/lib"


def test_a_device_node_is_refused(tmp_path, root) -> None:
    with pytest.raises(ImageError, match="member 'dev/mem': a device node"):
        apply(tmp_path, root, [Dir("dev"), Device("dev/mem", "c", 1, 1)])
    with pytest.raises(ImageError, match="a device node"):
        apply(tmp_path, root, [Device("sda", "b", 8, 0)])


def test_a_fifo_is_made_and_never_opened(tmp_path, root) -> None:
    apply(tmp_path, root, [Fifo("run-fifo")])
    assert stat.S_ISFIFO((root / "run-fifo").lstat().st_mode)


def test_too_many_files_are_refused_by_the_file_bound(tmp_path, root) -> None:
    with pytest.raises(ImageError, match="more than 100 members"):
        apply(tmp_path, root, [File(f"f{n}") for n in range(60)], [File(f"g{n}") for n in range(41)])
    # a million empty files is over the default bound too (not written here: the bound is the same code)
    assert ImageLimits().max_files < 1_000_000


def test_a_10_gib_file_is_refused_from_its_header_before_its_data(tmp_path, root) -> None:
    """A header claiming 10 GiB followed by 1 MiB: refused at the header, nothing written."""
    info = tarfile.TarInfo("huge")
    info.size = 10 * 1024**3
    blob = info.tobuf(tarfile.PAX_FORMAT) + bytes(1024**2)
    with pytest.raises(ImageError, match=r"member 'huge': a file of 10737418240 bytes, over the 4194304"):
        apply(tmp_path, root, blob)
    with pytest.raises(ImageError, match="would take the image's files over 8589934592 bytes"):
        apply(tmp_path, root, blob, limits=ImageLimits(max_file_bytes=16 * 1024**3))
    assert not (root / "huge").exists()


def test_a_10_gib_sparse_file_is_refused(tmp_path, root) -> None:
    """GNU tar's own sparse members (old GNU and pax forms) of a 10 GiB file with no data."""
    require(shutil.which("tar") is not None, "GNU tar is not installed")
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "sparse", "wb") as out:
        out.truncate(10 * 1024**3)
    for form in ("gnu", "pax"):
        blob = subprocess.run(["tar", "--sparse", f"--format={form}", "-cf", "-", "-C", str(tmp_path / "src"),
                               "sparse"], check=True, capture_output=True).stdout
        assert len(blob) < 1024**2
        with pytest.raises(ImageError, match="sparse"):
            apply(tmp_path, root, blob, compression="")
        assert not (root / "sparse").exists()


def test_a_stream_that_ends_inside_a_member_is_refused(tmp_path, root) -> None:
    whole = layer_tar([File("a", b"x" * 5000)])
    with pytest.raises(ImageError, match="ended inside"):
        apply(tmp_path, root, whole[:3000])


def test_a_decompression_bomb_after_the_tar_is_refused(tmp_path, root) -> None:
    """Zeros after the end of the archive still come out of gzip and count."""
    blob = layer_tar([File("a", b"x")]) + bytes(SMALL.max_stream_bytes + 1)
    with pytest.raises(ImageError, match="decompress to more than"):
        apply(tmp_path, root, blob)


def test_whiteouts_and_an_opaque_directory_across_three_layers(tmp_path, root) -> None:
    apply(tmp_path, root,
          [Dir("etc"), File("etc/motd", "hi"), File("etc/keep", "k"), Dir("etc/conf.d"), File("etc/conf.d/a", "a"),
           Dir("opt"), File("opt/old", "o"), Dir("opt/sub"), File("opt/sub/deep", "d"), Dir("var"),
           File("var/log", "l")],
          [Whiteout("etc/motd"), File("etc/new", "n"), Opaque("opt"), File("opt/fresh", "f"),
           Whiteout("var"), File("etc/conf.d/b", "b")],
          # a whiteout after the entry it names in the same layer hides only the lower layers' entry
          [File("etc/motd", "again"), Whiteout("etc/motd"), Opaque("etc/conf.d"), File("etc/conf.d/c", "c"),
           Whiteout("etc/nonexistent")])
    assert tree(root) == {
        "etc": "d", "etc/keep": "k", "etc/new": "n", "etc/motd": "again",
        "etc/conf.d": "d", "etc/conf.d/c": "c",
        "opt": "d", "opt/fresh": "f",
    }


def test_an_opaque_marker_after_its_siblings_keeps_the_same_layers_entries(tmp_path, root) -> None:
    apply(tmp_path, root, [Dir("d"), File("d/lower", "1"), Dir("d/sub"), File("d/sub/lower", "2")],
          [File("d/sub/upper", "3"), File("d/upper", "4"), Opaque("d")])
    assert tree(root) == {"d": "d", "d/sub": "d", "d/sub/upper": "3", "d/upper": "4"}


def test_a_whiteout_through_a_symlink_is_refused(tmp_path, root, outside) -> None:
    with pytest.raises(ImageError, match="goes through the link 'link'"):
        apply(tmp_path, root, [Symlink("link", str(outside))], [Whiteout("link/secret")])
    assert_untouched(outside)


def test_a_whiteout_of_the_directory_itself_is_refused(tmp_path, root) -> None:
    with pytest.raises(ImageError, match="names no entry"):
        apply(tmp_path, root, [Dir("a"), File("a/.wh..", b"")])


def test_a_setuid_root_file_keeps_its_mode_and_owner_in_a_tree_no_other_user_reaches(tmp_path, root) -> None:
    apply(tmp_path, root, [Dir("bin", 0o755), File("bin/su", b"#!", 0o4755, 0, 0),
                           File("bin/wall", b"w", 0o2755, 0, 5), File("home", b"", 0o640, 1000, 1000),
                           Dir("tmp", 0o1777)])
    su = (root / "bin" / "su").stat()
    assert (stat.S_IMODE(su.st_mode), su.st_uid, su.st_gid) == (0o4755, 0, 0)
    wall = (root / "bin" / "wall").stat()
    assert (stat.S_IMODE(wall.st_mode), wall.st_gid) == (0o2755, 5)
    assert ((root / "home").stat().st_uid, (root / "home").stat().st_gid) == (1000, 1000)
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    assert stat.S_IMODE(root.parent.stat().st_mode) == 0o700 and root.parent.stat().st_uid == 0
    reach = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "stat", str(root / "bin/su")],
                           capture_output=True, text=True)
    assert reach.returncode != 0 and "Permission denied" in reach.stderr


def test_a_set_id_file_owned_by_another_user_keeps_its_bits_after_chown(tmp_path, root) -> None:
    apply(tmp_path, root, [File("tool", b"t", 0o6755, 1000, 1000)])
    info = (root / "tool").stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o6755, 1000)


def test_hardlinks_to_a_file_of_the_image_work(tmp_path, root) -> None:
    apply(tmp_path, root, [Dir("bin"), File("bin/busybox", b"bb", 0o755), Hardlink("bin/ls", "bin/busybox")],
          [Hardlink("bin/cat", "./bin/busybox")])
    assert (root / "bin/ls").stat().st_ino == (root / "bin/busybox").stat().st_ino == (root / "bin/cat").stat().st_ino


@pytest.mark.parametrize("layers, why", [
    ([[Hardlink("h", "../outside/secret")]], "'..'"),
    ([[Hardlink("h", "/etc/passwd")]], "absolute"),
    ([[Symlink("l", "/OUTSIDE")], [Hardlink("h", "l/secret")]], "goes through the link 'l'"),
    ([[Symlink("l", "/OUTSIDE/secret")], [Hardlink("h", "l")]], "not a regular file"),
    ([[Dir("d")], [Hardlink("h", "d")]], "not a regular file"),
    ([[Hardlink("h", "missing")]], "not a regular file"),
])
def test_hardlinks_outside_through_links_or_to_non_files_are_refused(tmp_path, root, outside, layers, why) -> None:
    layers = [[Symlink(e.name, e.target.replace("/OUTSIDE", str(outside))) if isinstance(e, Symlink) else e
               for e in layer] for layer in layers]
    with pytest.raises(ImageError, match=why):
        apply(tmp_path, root, *layers)
    assert_untouched(outside)
    assert not (root / "h").exists()


def test_a_file_replaces_a_directory_and_a_directory_replaces_a_file(tmp_path, root) -> None:
    apply(tmp_path, root, [Dir("x"), Dir("x/sub"), File("x/sub/f", "1"), File("y", "file"), Symlink("z", "/etc")],
          [File("x", "now a file"), Dir("y"), File("y/inside", "2"), Dir("z")])
    assert tree(root) == {"x": "now a file", "y": "d", "y/inside": "2", "z": "d"}


def test_a_directory_over_a_directory_keeps_its_contents_and_takes_the_new_mode(tmp_path, root) -> None:
    apply(tmp_path, root, [Dir("d", 0o755), File("d/f", "1")], [Dir("d", 0o750, 0, 4)])
    assert tree(root) == {"d": "d", "d/f": "1"}
    assert stat.S_IMODE((root / "d").stat().st_mode) == 0o750 and (root / "d").stat().st_gid == 4


def test_a_file_replacing_a_symlink_writes_the_link_not_its_target(tmp_path, root, outside) -> None:
    apply(tmp_path, root, [Symlink("s", str(outside / "secret"))], [File("s", "mine")])
    assert (root / "s").read_text() == "mine" and not (root / "s").is_symlink()
    assert_untouched(outside)


def test_a_blob_changed_after_the_fetch_verified_it_is_refused_when_applied(tmp_path, root) -> None:
    layers = layers_of(tmp_path, [File("a", "x" * 100)], compression="")
    data = bytearray(layers[0].path.read_bytes())
    data[600] ^= 1  # inside the file's data: the tar stays valid
    layers[0].path.write_bytes(bytes(data))
    with pytest.raises(ImageError, match="sha256 changed since the fetch verified it"):
        apply_layers(layers, root, SMALL)


def test_plain_and_zstd_layers_apply_like_gzip(tmp_path, root) -> None:
    require(shutil.which("zstd") is not None, "zstd is not installed")
    tar = layer_tar([Dir("a"), File("a/b", "plain")])
    zst = subprocess.run(["zstd", "-q", "-c"], input=tar, check=True, capture_output=True).stdout
    apply(tmp_path, root, zst, compression="", media_type="application/vnd.oci.image.layer.v1.tar+zstd")
    assert tree(root) == {"a": "d", "a/b": "plain"}
    apply(tmp_path, root, layer_tar([File("a/c", "z")]), compression="")
    assert tree(root) == {"a": "d", "a/b": "plain", "a/c": "z"}


def test_a_corrupt_zstd_layer_is_refused(tmp_path, root) -> None:
    require(shutil.which("zstd") is not None, "zstd is not installed")
    zst = subprocess.run(["zstd", "-q", "-c"], input=layer_tar([File("a", "x" * 10000)]), check=True,
                         capture_output=True).stdout
    with pytest.raises(ImageError, match="zstd|ended inside|not a valid tar"):
        apply(tmp_path, root, zst[: len(zst) // 2], compression="",
              media_type="application/vnd.oci.image.layer.v1.tar+zstd")


def test_a_truncated_gzip_layer_is_refused(tmp_path, root) -> None:
    gz = gzip.compress(layer_tar([File("a", "x")]))
    with pytest.raises(ImageError, match="corrupt|ended inside"):
        apply(tmp_path, root, gz[:-6], compression="", media_type="application/vnd.oci.image.layer.v1.tar+gzip")


def test_the_root_entry_sets_the_roots_mode(tmp_path, root) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("./")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    apply(tmp_path, root, out.getvalue())
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
