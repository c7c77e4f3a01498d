"""The initramfs: a static busybox, the guest modules and a tiny init that mounts the root disk.

Built with the host's cpio (newc format) so nothing of the host but busybox-static goes in.
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
from pathlib import Path

from vmimages.kernel import Kernel
from vmimages.run import BuildError

BUSYBOX = Path("/bin/busybox")  # from Debian's busybox-static: no shared libraries needed
GUEST_DIR = Path(__file__).parent / "guest"


def build(kernel: Kernel, out: Path, work: Path) -> Path:
    """Write the initramfs to `out` (gzip-compressed newc cpio)."""
    if not BUSYBOX.exists():
        raise BuildError(f"{BUSYBOX} is missing: apt-get install busybox-static")
    shutil.rmtree(work, ignore_errors=True)
    for sub in ("bin", "modules", "proc", "sys", "dev", "newroot"):
        (work / sub).mkdir(parents=True)
    shutil.copy2(BUSYBOX, work / "bin" / "busybox")
    shutil.copy2(GUEST_DIR / "initramfs-init", work / "init")
    (work / "init").chmod(0o755)
    names = []
    for module in kernel.module_files():
        shutil.copy2(module, work / "modules" / module.name)
        names.append(module.name)
    (work / "modules.order").write_text("\n".join(names) + "\n")
    files = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    cpio = subprocess.run(
        ["cpio", "--quiet", "-o", "-H", "newc", "--reproducible", "-R", "0:0"],
        cwd=work,
        input="\n".join(files).encode(),
        capture_output=True,
    )
    if cpio.returncode != 0:
        raise BuildError(f"cpio failed: {cpio.stderr.decode(errors='replace')}")
    out.write_bytes(gzip.compress(cpio.stdout, compresslevel=6, mtime=0))
    shutil.rmtree(work)
    return out
