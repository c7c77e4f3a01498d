"""Docker benchmark: what the `docker` template costs a job against the bare one, measured in one run.

Run as root on a host with the `base` and `docker` templates built:  .venv/bin/python bench/docker.py
For each sample, on a VM restored from its snapshot with no spare ready (a pool miss, on the clock):
  base    restore to the output of `echo ok` (the bare-template job)
  docker  restore to the engine's answer (`docker version` of the server), then `docker build` of a small
          context (FROM scratch + a static busybox) and `docker run --rm` of it, and restore to its output
Prints the details, then as its last line one JSON object of medians, p99s and ratios from this run.
`--smoke` (the test suite's run): one sample of each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile as pct
from runner.sandbox import Sandbox
from runner.vm.engine import Engine
from runner.vm.statedir import StateDir
from runner.vm.templates import TemplateStore

DOCKERFILE = 'FROM scratch\nCOPY busybox /bin/busybox\nENTRYPOINT ["/bin/busybox"]\n'
BUSYBOX = Path("/bin/busybox")


def timed_until(sbx: Sandbox, command: str, marker: bytes, started: float, cwd: str = "/") -> float:
    """Milliseconds from `started` to the moment `marker` appears in the command's output."""
    seen: list[float] = []

    def on_output(stream: str, data: bytes) -> None:
        if marker in data and not seen:
            seen.append(time.monotonic())

    r = sbx.exec(command, cwd=cwd, on_output=on_output, timeout_seconds=600)
    if r.exit_code != 0 or not seen:
        raise RuntimeError(f"{command!r} failed (exit {r.exit_code}): {r.stderr.decode(errors='replace')[-500:]}")
    return (seen[0] - started) * 1000


def base_job(engine: Engine) -> dict[str, float]:
    started = time.monotonic()
    with Sandbox.create(template="base", engine=engine) as sbx:
        return {"restore_to_output": timed_until(sbx, "echo ok", b"ok", started)}


def docker_job(engine: Engine, context: Path) -> dict[str, float]:
    started = time.monotonic()
    with Sandbox.create(template="docker", engine=engine) as sbx:
        engine_ready = timed_until(sbx, "docker version -f '{{.Server.Version}}'", b".", started)
        sbx.copy_in(context, "/workspace/ctx")
        t = time.monotonic()
        build = timed_until(sbx, "docker build -q -t t . && echo built", b"built", t, cwd="/workspace/ctx")
        t = time.monotonic()
        run = timed_until(sbx, "docker run --rm t echo ok", b"ok", t)
        return {"restore_to_engine": engine_ready, "build": build, "run": run,
                "restore_to_run_output": (time.monotonic() - started) * 1000}


def measure(samples: int, job: Callable[[], dict[str, float]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for _ in range(samples):
        for name, value in job().items():
            out.setdefault(name, []).append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a quick run that only proves the benchmark works")
    args = parser.parse_args()
    samples = 1 if args.smoke else args.samples
    templates = TemplateStore(StateDir.default().templates)
    with tempfile.TemporaryDirectory(prefix="mvc-bench-docker-") as tmp:
        context = Path(tmp) / "ctx"
        context.mkdir()
        (context / "Dockerfile").write_text(DOCKERFILE)
        shutil.copy2(BUSYBOX, context / "busybox")
        engine = Engine(StateDir(Path(tmp) / "state"), templates=templates, pool_size=0)
        try:
            # Alternated, so load on the shared machine falls on both alike.
            base: dict[str, list[float]] = {}
            docker: dict[str, list[float]] = {}
            for _ in range(samples):
                for into, numbers in ((base, measure(1, lambda: base_job(engine))),
                                      (docker, measure(1, lambda: docker_job(engine, context)))):
                    for name, values in numbers.items():
                        into.setdefault(name, []).extend(values)
        finally:
            engine.close()
    result: dict[str, float] = {"samples": samples}
    for template, numbers in (("base", base), ("docker", docker)):
        for name, values in numbers.items():
            print(f"{template + ' ' + name:<30} n={len(values):<3} p50={pct(values, 0.5):9.1f}  "
                  f"p99={pct(values, 0.99):9.1f}  (ms)")
            result[f"{template}_{name}_p50_ms"] = round(pct(values, 0.5), 1)
            result[f"{template}_{name}_p99_ms"] = round(pct(values, 0.99), 1)
    bare = result["base_restore_to_output_p50_ms"]
    result["docker_engine_vs_bare_job"] = round(result["docker_restore_to_engine_p50_ms"] / bare, 2)
    result["docker_run_output_vs_bare_job"] = round(result["docker_restore_to_run_output_p50_ms"] / bare, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
