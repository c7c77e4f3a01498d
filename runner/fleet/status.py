"""`microvm-check status`: the host's runners, VMs and queue, as the running service last wrote them
(`write`, on each of the fleet's passes) and this reads them (`load`, `render`)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATUS_FILE = "fleet-status.json"  # in the service's state directory
MAX_STATUS = 4 * 1024 * 1024


def write(path: Path, status: dict[str, Any]) -> None:
    """The status for `load`: root's file, replaced in one step so a reader never sees half of it. A failed
    write is logged, not raised: the fleet's pass goes on without its report."""
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(json.dumps(status))
        temporary.chmod(0o600)
        temporary.replace(path)
    except OSError as exc:
        log.warning("cannot write the fleet status to %s: %s", path, exc)


def load(path: Path) -> dict[str, Any]:
    """The status the fleet wrote; ValueError saying why there is none."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_STATUS)
    except FileNotFoundError:
        raise ValueError(f"no fleet status at {path}: is `microvm-check serve` running with a runners: "
                         "section in its config?") from None
    status = json.loads(data)
    if not isinstance(status, dict):
        raise ValueError(f"the fleet status at {path} is not a JSON object: remove it, the service rewrites it")
    return status


def render(status: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    age = now - float(status.get("updated_at", now))
    lines = [f"runners for org {status.get('org')} (labels {', '.join(status.get('labels', []))}): "
             f"{len(status.get('runners', []))} of at most {status.get('max_runners')}, "
             f"{status.get('min_idle')} kept idle; status {age:.0f} s old"
             + ("; SHUTTING DOWN" if status.get("stopping") else "")]
    for runner in status.get("runners", []):
        since = f"since {_ago(now - float(runner['since']))}"
        job = runner.get("job")
        doing = (f"busy with {job['repository']} run {job['run_id']} (attempt {job['run_attempt']}) job {job['job']}"
                 if job else "idle")
        lines.append(f"  {runner['name']:<28} {doing}, {since}")
    if status.get("crash_loop"):
        lines += _crash_loop(status["crash_loop"], now)
    if status.get("to_deregister"):
        lines.append(f"  to deregister (GitHub still lists them): {', '.join(map(str, status['to_deregister']))}")
    lines.append(f"queued GitHub jobs waiting for a runner here: {status.get('pending_jobs', 0)}")
    vms = status.get("vms", [])
    lines.append(f"VMs: {len(vms)}" + (f" ({', '.join(vm['id'] for vm in vms)})" if vms else ""))
    queue = status.get("queue")
    if queue:
        lines.append(f"jobs: {queue.get('running', 0)} running, {queue.get('queued', 0)} queued, "
                     f"{queue.get('warm', 0)} pre-warmed VMs")
    return "\n".join(lines)


def _crash_loop(loop: dict[str, Any], now: float) -> list[str]:
    """Runners that keep ending before they take a job (runner.fleet.starts): how, and what the last said."""
    wait = max(0.0, float(loop.get("next_try_at", now)) - now)
    return [f"  CRASH LOOP: {loop.get('tries')} runners in a row ended before taking a job; the last, "
            f"{loop.get('runner')}, ended ({loop.get('exit')}) {loop.get('lived_seconds')} s after its start; "
            f"next try in {wait:.0f} s; its last output:",
            *(f"    {line}" for line in loop.get("output") or ["(nothing)"])]


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h"
