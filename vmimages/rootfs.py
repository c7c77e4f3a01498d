"""The template's root filesystem: Debian minbase plus what checks need, our init and the agent.

debootstrap is the slow part (about 90 s), so its output is cached by the package list; the
customisation and the ext4 image are cheap and rebuilt whenever the recipe (incl. agent) changes.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from runner.vm import guestwire
from vmimages.initramfs import GUEST_DIR
from vmimages.kernel import Kernel
from vmimages.run import run

# The guest's /opt/microvm-check: installed name -> source. The agent imports the wire protocol by
# its installed name; the host imports the same file as runner.vm.guestwire, so the two cannot drift.
AGENT_FILES = {"agent.py": GUEST_DIR / "agent.py", "guestwire.py": Path(guestwire.__file__)}
FREE_SPACE_MIB = 2048  # room for the job's checkout, venvs and build output (overlay grows sparse)
GUEST_USER = ("runner", 1000)


def debootstrap(suite: str, packages: tuple[str, ...], cache: Path) -> Path:
    """A cached debootstrap tree for (suite, packages)."""
    key = hashlib.sha256(f"{suite}|{','.join(sorted(packages))}".encode()).hexdigest()[:16]
    tree = cache / "rootfs" / f"{suite}-{key}"
    if (tree / ".complete").exists():
        return tree
    partial = tree.with_name(tree.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    argv = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite, str(partial)]
    run(argv)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        shutil.rmtree(partial / junk, ignore_errors=True)
        (partial / junk).mkdir(parents=True)
    (partial / ".complete").touch()
    shutil.rmtree(tree, ignore_errors=True)
    partial.rename(tree)
    return tree


def customise(base: Path, work: Path) -> Path:
    """Copy the cached tree and add init, agent, user and workspace (never touching the cache)."""
    shutil.rmtree(work, ignore_errors=True)
    run(["cp", "-a", "--reflink=auto", str(base), str(work)])
    (work / ".complete").unlink(missing_ok=True)
    install_agent(work / "opt" / "microvm-check")
    shutil.copy2(GUEST_DIR / "init", work / "sbin" / "microvm-init")
    (work / "sbin" / "microvm-init").chmod(0o755)
    user, uid = GUEST_USER
    run(["chroot", str(work), "useradd", "-m", "-u", str(uid), "-s", "/bin/bash", user])
    (work / "workspace").mkdir(mode=0o777)
    (work / "workspace").chmod(0o777)
    (work / "etc" / "hostname").write_text("microvm\n")
    (work / "etc" / "hosts").write_text("127.0.0.1 localhost microvm\n")
    (work / "etc" / "fstab").write_text("/dev/vda / ext4 rw,noatime 0 1\n")
    return work


def install_modules(kernel: Kernel, trees: tuple[str, ...], root: Path) -> None:
    """Copy the module files under `trees` (with their dependencies) into `root`'s /lib/modules and index
    them with depmod, so the guest's modprobe and the kernel's on-demand loading find them."""
    if not trees:
        return
    dest = root / "lib" / "modules" / kernel.version
    for module in kernel.module_closure(trees):
        (dest / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(kernel.modules_dir / module, dest / module)
    for index in ("modules.builtin", "modules.builtin.modinfo", "modules.order"):
        shutil.copy2(kernel.modules_dir / index, dest / index)
    run(["depmod", "-b", str(root), kernel.version])


def install_agent(agent_dir: Path) -> None:
    """Lay out the agent as the guest runs it (also how the host's tests load it, to test that layout)."""
    agent_dir.mkdir(parents=True)
    for name, source in AGENT_FILES.items():
        shutil.copy2(source, agent_dir / name)


def make_image(tree: Path, image: Path, free_mib: int = FREE_SPACE_MIB) -> Path:
    """An ext4 image of `tree` with `free_mib` of free space, built without mounting anything."""
    used_kib = int(run(["du", "-sk", "--apparent-size", str(tree)]).split()[0])
    size_mib = used_kib // 1024 + free_mib
    image.unlink(missing_ok=True)
    run(["mkfs.ext4", "-q", "-F", "-L", "microvm-root", "-E", "root_owner=0:0",
         "-d", str(tree), str(image), f"{size_mib}M"])
    return image
