"""Image template benchmark: what an OCI image template costs beside `base`, in the same run.

Builds (forced, timed) a template from a small OCI image made here (Debian's static busybox and its
applets, an OCI layout directory: no registry, no network), then alternates restore-to-first-command on
it and on `base`, samples apart, so load on the shared machine falls on both alike. Run as root with
`base` built:  .venv/bin/python bench/image.py [--samples N]

The figures (issue 34): image restore-to-first-command p50/p99 and its ratio to `base`'s (goal: within
1.2x), the template build time, and the first job on the template right after its build. The last line
is one JSON object of numbers. `--smoke` (tests/test_bench_smoke.py): two samples of each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile as pct
from runner.sandbox import Sandbox
from runner.vm.engine import Engine
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateStore
from tests.vmimages.oci.images import Dir, File, Symlink, write_layout
from vmimages.build import build
from vmimages.recipebook import for_image

TEMPLATE = "bench-image-busybox"
BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "echo", "true", "cat", "ls")


def make_layout(directory: Path) -> str:
    """A one-layer image with busybox and no Python; its `oci:` reference."""
    entries = [Dir("bin"), File("bin/busybox", BUSYBOX.read_bytes(), mode=0o755),
               *(Symlink(f"bin/{name}", "busybox") for name in APPLETS), Dir("etc"),
               File("etc/os-release", "ID=benchbusy\n"), Dir("tmp", mode=0o1777), Dir("work", mode=0o777)]
    return write_layout(directory, [entries], env=("PATH=/bin",), workdir="/work").ref


def first_command_ms(engine: Engine, template: str) -> float:
    """Restore (no spare VM) to the first command's output: what a job waits for before its own work."""
    started = time.monotonic()
    with Sandbox.create(template=template, engine=engine) as sbx:
        result = sbx.exec(["echo", "ok"], cwd="/", timeout_seconds=120)
        if result.exit_code != 0 or b"ok" not in result.stdout:
            raise RuntimeError(f"{template}: echo ok failed: {result.stderr.decode(errors='replace')[-300:]}")
        return (time.monotonic() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    args = parser.parse_args()
    samples = 2 if args.smoke else args.samples
    state = StateDir.default()
    with tempfile.TemporaryDirectory(prefix="mvc-bench-image-") as tmp:
        reference = make_layout(Path(tmp) / "layout")
        started = time.monotonic()
        build(for_image(TEMPLATE, reference), state, force=True)
        build_s = time.monotonic() - started
        engine = Engine(StateDir(Path(tmp) / "state"), templates=TemplateStore(state.templates), pool_size=0)
        try:
            first_job = first_command_ms(engine, TEMPLATE)
            image: list[float] = []
            base: list[float] = []
            for _ in range(samples):
                base.append(first_command_ms(engine, "base"))
                image.append(first_command_ms(engine, TEMPLATE))
        finally:
            engine.close()
            TemplateStore(state.templates).remove(TEMPLATE)  # the benchmark's own template takes no disk after it
    for name, values in (("base", base), ("image", image)):
        print(f"{name + ' restore to first command':<36} n={len(values):<3} p50={pct(values, 0.5):8.1f}  "
              f"p99={pct(values, 0.99):8.1f}  (ms)")
    print(f"template build (forced): {build_s:.1f} s; first job after it: {first_job:.0f} ms")
    result = {
        "samples": samples,
        "image_first_command_p50_ms": round(pct(image, 0.5), 1),
        "image_first_command_p99_ms": round(pct(image, 0.99), 1),
        "base_first_command_p50_ms": round(pct(base, 0.5), 1),
        "base_first_command_p99_ms": round(pct(base, 0.99), 1),
        "image_vs_base_p50": round(pct(image, 0.5) / pct(base, 0.5), 2),
        "template_build_s": round(build_s, 1),
        "first_job_ms": round(first_job, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
