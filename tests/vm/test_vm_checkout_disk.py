"""The checkout as a disk (runner/vm/checkoutdisk.py): the host-side unpack on its own, then real VMs."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import uuid

import pytest

from runner import tarsafe
from runner.vm import checkoutdisk
from runner.vm.errors import SandboxError


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname = kind, mode, link
    return info


# ---- the host side, no VM ------------------------------------------------------------------------


def test_unpack_keeps_links_and_modes_but_no_set_id_bits(tmp_path):
    tree = tmp_path / "tree"
    unpacked = checkoutdisk.unpack(tar_of(
        (member("bin/tool", mode=0o4755), b"#!/bin/sh\n"),
        (member("secret", mode=0o600), b"s"),
        (member("current", tarfile.SYMTYPE, link="bin"), None),
        (member("outside", tarfile.SYMTYPE, link="/etc/passwd"), None),
        (member("again", tarfile.LNKTYPE, link="bin/tool"), None),
    ), tree)
    assert (tree / "bin" / "tool").stat().st_mode & 0o7777 == 0o755
    assert (tree / "secret").stat().st_mode & 0o777 == 0o600
    assert os.readlink(tree / "current") == "bin" and os.readlink(tree / "outside") == "/etc/passwd"
    assert (tree / "again").stat().st_ino == (tree / "bin" / "tool").stat().st_ino
    assert (unpacked.files, unpacked.links, unpacked.root_given) == (2, 2, False)


def test_unpack_never_writes_through_a_link_of_the_archive(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    with pytest.raises(OSError):
        checkoutdisk.unpack(tar_of(
            (member("up", tarfile.SYMTYPE, link=str(outside)), None),
            (member("up/planted"), b"x"),
        ), tmp_path / "tree")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("bad, why", [
    ((member("../x"), b"x"), r"'\.\.' in the path"),
    ((member("dev", tarfile.CHRTYPE), None), "a device; a checkout holds files, directories and links only"),
    ((member("h", tarfile.LNKTYPE, link="/etc/shadow"), None), "absolute path"),
    ((member("h", tarfile.LNKTYPE, link="later"), None), "not an earlier regular file of the archive"),
])
def test_unpack_refuses_what_a_checkout_never_holds(tmp_path, bad, why):
    with pytest.raises(tarsafe.UnsafeTar, match=why):
        checkoutdisk.unpack(tar_of(bad, (member("later"), b"x")), tmp_path / "tree")


def test_a_later_member_of_the_same_name_wins_as_with_tar(tmp_path):
    checkoutdisk.unpack(tar_of((member("f"), b"old"), (member("f"), b"new")), tmp_path / "tree")
    assert (tmp_path / "tree" / "f").read_bytes() == b"new"


def test_mountable_destinations():
    assert checkoutdisk.mountable("/workspace/t")
    for dest in ("/", "workspace", "/a,b", "/a:b", "/a\\b"):
        assert not checkoutdisk.mountable(dest), dest


# ---- real VMs ------------------------------------------------------------------------------------


def test_the_checkout_is_an_overlay_on_a_medium_byte_exact_with_links_and_modes(sandbox, tmp_path):
    src = tmp_path / "src"
    files = {"bin/tool": b"#!/bin/sh\necho tool\n", "data/random.bin": os.urandom(3 << 20), "secret": b"s",
             ".git/HEAD": b"ref: refs/heads/main\n", "d1/d2/d3/deep.txt": b"deep"}
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    (src / "bin" / "tool").chmod(0o755)
    (src / "secret").chmod(0o600)
    (src / "empty").mkdir()
    (src / "current").symlink_to("bin")
    sandbox.copy_in(src, "/workspace/t")
    names = " ".join(files)
    r = sandbox.exec(f"./current/tool && stat -c '%n %U %a' bin/tool secret empty && readlink current && "
                     f"sha256sum {names} && awk '$2 == \"/workspace/t\" {{print $3}}' /proc/mounts && "
                     "mv d1 moved && ls moved/d2/d3", cwd="/workspace/t")
    assert r.exit_code == 0, r.stderr
    sums = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in files.items()).encode()
    assert r.stdout == (b"tool\nbin/tool root 755\nsecret root 600\nempty root 755\nbin\n" + sums
                        + b"overlay\ndeep.txt\n")


def test_a_100_mib_checkout_arrives_whole(sandbox, tmp_path):
    blob = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with open(blob, "wb") as f:
        for _ in range(100):
            chunk = os.urandom(1 << 20)
            f.write(chunk)
            digest.update(chunk)
    with open(blob, "rb") as data:
        info = member("big.bin")
        info.size = 100 << 20

        def stream():
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            while chunk := data.read(1 << 20):
                yield chunk
            yield bytes(1024)

        sandbox.put_tar(stream(), "/workspace")
    r = sandbox.exec("sha256sum big.bin")
    assert r.stdout.split()[0].decode() == digest.hexdigest()


def test_a_checkout_of_20000_small_files(sandbox):
    count = 20_000
    members = [(member(f"pkg{i // 1000}/m{i}.py"), b"N = %d\n" % i) for i in range(count)]
    sandbox.put_tar(tar_of(*members), "/workspace")
    r = sandbox.exec("find . -type f | wc -l && cat pkg*/m*.py | awk '{s += $3} END {print s}' && cat pkg19/m19999.py")
    assert r.stdout == f"{count}\n{count * (count - 1) // 2}\nN = 19999\n".encode()


def test_two_jobs_of_one_pool_each_see_only_their_own_checkout(make_engine):
    from runner.sandbox import Sandbox

    engine = make_engine(pool_size=1)
    seen = []
    for job in ("first", "second"):
        with Sandbox.create(engine=engine) as sbx:
            sbx.put_tar(tar_of((member("same/name.txt"), job.encode() * 1000)), "/workspace")
            seen.append(sbx.exec("cat same/name.txt").stdout)
    assert seen == [b"first" * 1000, b"second" * 1000]


def test_a_medium_that_is_not_the_announced_one_is_refused(sandbox, tmp_path):
    """The guest reads the superblock after flushing the drive's buffers: a stale or foreign medium
    (here: a UUID other than the one the host announces) is never mounted."""
    vm = sandbox._vm
    (tmp_path / "root" / checkoutdisk.TREE).mkdir(parents=True)
    image = vm.dir / "foreign.img"
    checkoutdisk.make_image(tmp_path / "root", image, checkoutdisk.Unpacked(), str(uuid.uuid4()))
    vm.machine.change_medium(image)
    want = str(uuid.uuid4())
    with pytest.raises(SandboxError, match=f"not the checkout's {want}"):
        sandbox._call(lambda a: a.call({"op": "checkout", "device": "/dev/sr0", "uuid": want,
                                        "dir": checkoutdisk.TREE, "dest": "/workspace"}, 60))


def test_a_second_tar_into_the_same_vm_goes_through_the_agent(sandbox):
    sandbox.put_tar(tar_of((member("f.txt"), b"one")), "/workspace")
    sandbox.put_tar(tar_of((member("f.txt"), b"two"), (member("g.txt"), b"g")), "/workspace")
    assert sandbox.exec("cat f.txt g.txt").stdout == b"twog"


def test_a_checkout_with_a_device_is_refused_and_the_sandbox_survives(sandbox):
    with pytest.raises(SandboxError, match="cannot unpack the tar stream into /workspace: .*a device"):
        sandbox.put_tar(tar_of((member("dev", tarfile.CHRTYPE), None)), "/workspace")
    assert sandbox.exec("true").exit_code == 0
