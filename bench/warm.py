"""Warm base benchmark: a pytest job cold (its dependencies installed in the job) and from a warm base.

Run as root on a host with the template built:  .venv/bin/python bench/warm.py [--samples N]

The checkout holds the wheels of pytest, pluggy, packaging, iniconfig, jinja2 and markupsafe
(`pip download`ed here into a cache directory, from PyPI), a requirements.txt and a small pytest
suite. Cold: a VM restored from the bare template creates a venv, installs the wheels and runs the
suite. Warm: the same setup ran once in a VM that was then snapshotted as a template (what the
service's warm bases are, `runner/service/jobs/bases.py`, built there from the default branch's tarball),
and each job restores from it and only runs the suite. Both are timed from the restore's start: to
the first test's output line and to the job's end. The last line is one JSON object with
cold_first_test_s, warm_first_test_s and warm_speedup (cold / warm time to the first test), all
measured in this same run.

`--smoke` (the test suite's run, tests/test_bench_smoke.py) downloads nothing: the checkout holds only
the suite, the setup makes a venv without pip and the "suite" is one python line printing the mark;
the same path (a warm base built from a VM, jobs restored from it) on a small job.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.sandbox import Sandbox
from runner.vm.engine import Engine
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateStore

PACKAGES = ("pytest", "pluggy", "packaging", "iniconfig", "jinja2", "markupsafe")
MARK = "FIRST-TEST-RUNNING"
SUITE = f'''\
import jinja2
import markupsafe
import packaging.version


def test_first():
    print("{MARK}", flush=True)


def test_template_renders():
    assert jinja2.Template("hello {{{{ name }}}}").render(name="vm") == "hello vm"


def test_escape():
    assert markupsafe.escape("<b>") == "&lt;b&gt;"


def test_versions_compare():
    assert packaging.version.Version("1.10") > packaging.version.Version("1.9")
'''
SMOKE_SETUP = "python3 -m venv --without-pip /opt/venv"
SMOKE_TESTS = f"/opt/venv/bin/python -c 'print(\"{MARK}\", flush=True)'"
SETUP = ("python3 -m venv /opt/venv && /opt/venv/bin/pip install --quiet --no-index --no-cache-dir "
         "--find-links /workspace/wheels -r /workspace/requirements.txt")
TESTS = "PYTHONUNBUFFERED=1 /opt/venv/bin/python -m pytest -q -s -p no:cacheprovider tests"


@dataclass
class Timing:
    ready_s: float
    first_test_s: float
    total_s: float


def download_wheels(cache: Path) -> list[Path]:
    """The packages' wheels (and nothing else) for the guest's CPython, into `cache` (kept between runs)."""
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-I", "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                    "--dest", str(cache.resolve()), *PACKAGES], check=True, cwd="/")
    wheels = sorted(cache.glob("*.whl"))
    names = {w.name.split("-")[0].lower() for w in wheels}
    missing = [p for p in PACKAGES if p not in names]
    if missing:
        raise SystemExit(f"pip download left out {', '.join(missing)} in {cache}")
    return wheels


def checkout(wheels: list[Path]) -> bytes:
    out = io.BytesIO()
    files = {"requirements.txt": "\n".join(PACKAGES).encode() + b"\n", "tests/test_small.py": SUITE.encode(),
             **{f"wheels/{w.name}": w.read_bytes() for w in wheels}}
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def run_job(engine: Engine, template: str, tar: bytes, command: str) -> Timing:
    """One job: restore, checkout in, the command; times from the restore's start."""
    first: list[float] = []
    seen = bytearray()
    lock = threading.Lock()

    def watch(stream: str, data: bytes) -> None:
        with lock:
            if not first:
                seen.extend(data)
                if MARK.encode() in seen:
                    first.append(time.monotonic())
                del seen[:-len(MARK)]

    begin = time.monotonic()
    with Sandbox.create(template=template, engine=engine, ttl_seconds=1800) as sbx:
        ready = time.monotonic()
        sbx.put_tar(io.BytesIO(tar))
        result = sbx.exec(command, timeout_seconds=1500, on_output=watch, capture_bytes=64 * 1024)
        end = time.monotonic()
    if result.exit_code != 0 or not first:
        raise SystemExit(f"the job failed (exit {result.exit_code}):\n{result.stdout.decode(errors='replace')}"
                         f"{result.stderr.decode(errors='replace')}")
    return Timing(ready - begin, first[0] - begin, end - begin)


def build_base(engine: Engine, tar: bytes, name: str, setup: str = SETUP) -> float:
    """What a warm base build does in a VM: the checkout, the setup, a snapshot. Seconds taken."""
    begin = time.monotonic()
    with Sandbox.create(template="base", engine=engine, ttl_seconds=1800) as sbx:
        sbx.put_tar(io.BytesIO(tar))
        result = sbx.exec(setup, timeout_seconds=1500, capture_bytes=64 * 1024)
        if result.exit_code != 0:
            raise SystemExit(f"the setup failed (exit {result.exit_code}): {result.stderr.decode(errors='replace')}")
        sbx.snapshot(name)
    return time.monotonic() - begin


def show(label: str, timings: list[Timing]) -> None:
    for t in timings:
        print(f"{label:<5} VM ready {t.ready_s:6.2f} s   first test {t.first_test_s:7.2f} s   total {t.total_s:7.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1, help="jobs of each kind (default 1)")
    parser.add_argument("--wheel-cache", type=Path, default=Path("/var/cache/microvm-check-bench/wheels"))
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    args = parser.parse_args()

    setup, tests = (SMOKE_SETUP, SMOKE_TESTS) if args.smoke else (SETUP, TESTS)
    wheels = [] if args.smoke else download_wheels(args.wheel_cache)
    tar = checkout(wheels)
    print(f"checkout: {len(wheels)} wheels, {len(tar) / 1e6:.1f} MB")
    shared = StateDir.default().templates
    with tempfile.TemporaryDirectory(prefix="mvc-bench-warm-", dir="/tmp") as tmp:
        templates = Path(tmp) / "templates"
        templates.mkdir()
        (templates / "base").symlink_to(shared / "base")  # the built template, read only; the base goes here
        engine = Engine(StateDir(Path(tmp) / "state"), templates=TemplateStore(templates), pool_size=0)
        try:
            build_s = build_base(engine, tar, "bench-warm", setup)
            print(f"warm base built in {build_s:.1f} s (checkout, setup, snapshot)")
            cold = [run_job(engine, "base", tar, f"{setup} && {tests}") for _ in range(args.samples)]
            warm = [run_job(engine, "bench-warm", tar, tests) for _ in range(args.samples)]
        finally:
            engine.close()
    show("cold", cold)
    show("warm", warm)
    cold_first = statistics.median(t.first_test_s for t in cold)
    warm_first = statistics.median(t.first_test_s for t in warm)
    print(json.dumps({
        "cold_first_test_s": round(cold_first, 2), "warm_first_test_s": round(warm_first, 2),
        "warm_speedup": round(cold_first / warm_first, 1),
        "cold_total_s": round(statistics.median(t.total_s for t in cold), 2),
        "warm_total_s": round(statistics.median(t.total_s for t in warm), 2),
        "warm_base_build_s": round(build_s, 1), "samples": args.samples,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
