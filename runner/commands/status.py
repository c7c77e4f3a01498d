"""`microvm-check status`: what the running service has now (GET /v1/status on its socket), on every host.

The VMs (each with the job it runs), the spare pools, the queue, the newest jobs and, when the config
has a `runners:` section, the fleet's runners. It asks the service rather than reading files, so what
it shows is what the service holds; the socket's operator check (root or the admin_group) applies.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from runner.fleet import status as fleet_status


def render(data: Mapping[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    lines = []
    queue = data.get("queue") or {}
    lines.append(f"service: {'up' if queue.get('ok') else 'STOPPING'}, accelerator {queue.get('accel') or 'not yet known'}; "
                 f"jobs: {queue.get('running', 0)} running, {queue.get('queued', 0)} queued, "
                 f"{queue.get('warm', 0)} pre-warmed VMs")
    vms = data.get("vms") or []
    pools = data.get("spare_pools")
    spares = sum((pools or {}).get("ready", {}).values()) if pools else 0
    lines.append(f"VMs: {len(vms) + spares} running ({len(vms)} with a job or a sandbox, {spares} spare)")
    for vm in vms:
        lines.append(f"  {vm.get('id')}  ready in {vm.get('ready_ms')} ms  " + (f"job {vm['job']}" if vm.get("job")
                                                                                   else "no job (sandbox or base build)"))
    if pools is None:
        lines.append("spare pools: none (no VM engine)")
    else:
        ready = pools.get("ready") or {}
        shown = ", ".join(f"{name} {count}/{pools.get('size')}" for name, count in sorted(ready.items())) or "empty"
        lines.append(f"spare pools (kept per template variant: {pools.get('size')}): {shown}")
    recent = data.get("recent_jobs") or []
    lines.append(f"recent jobs ({len(recent)}):" if recent else "recent jobs: none")
    for job in recent:
        lines.append("  " + job_line(job, now))
    fleet = data.get("fleet")
    if fleet:  # its VMs and queue lines are the ones above
        lines += [line for line in fleet_status.render(fleet, now).splitlines()
                  if not line.startswith(("VMs:", "jobs:"))]
    else:
        lines.append("runners: none (no runners: section in the config)")
    return "\n".join(lines)


def job_line(job: Mapping[str, Any], now: float) -> str:
    """One job record (its wire form) as a row: id, age, state and result, duration, repository, name, error."""
    t = job.get("timings") or {}
    took = f"{t['finished_at'] - t['started_at']:.1f}s" if t.get("finished_at") and t.get("started_at") else "-"
    code = "-" if job.get("exit_code") is None else str(job["exit_code"])
    age = max(0, int(now - float(job.get("created_at", now))))
    line = (f"{job.get('id')}  {_ago(age):>6} ago  {job.get('state', '?'):<17} exit {code:>3}  {took:>7}  "
            f"{job.get('repository')}@{str(job.get('sha', ''))[:8]} {job.get('job_name')}")
    return line + (f"  error: {str(job['error'])[:200]}" if job.get("error") else "")


def _ago(seconds: int) -> str:
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{seconds // length}{unit}"
    return f"{seconds}s"
