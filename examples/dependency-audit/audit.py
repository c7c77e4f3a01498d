"""A dependency-audit agent on the microvm-check SDK: install a lockfile's packages, one sandbox each, and audit them.

    python3 audit.py --lockfile requirements.txt --index http://10.0.0.5:8080/simple --advisories adv.json \
        [--policy registry-only.yml] [--socket S]

Every pinned requirement (`name==version`) is installed with `pip install` (install scripts included:
that is what an audit must survive) in a sandbox of its own whose egress policy allows the index only,
so a package's `setup.py` that phones home has nowhere to go: the service refuses the connection and
names it in the exec's `blocked_egress` (and on the sandbox's page). Then the installed versions are
checked against the advisories file (`{"name": {"version": "advisory text"}}`), as pip-audit does
against its database. The report is one JSON object on stdout: per package `installed`, `refused_egress`
(host:port the install tried), `advisories`, and a `verdict` of ok / vulnerable / hostile / failed.
Exit 1 when any package is not ok. Run it as a user in the service's `sandboxes.group`.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import urlsplit

from microvm_check import Sandbox, Service

PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)$")


def pins(lockfile: Path) -> list[tuple[str, str]]:
    found = []
    for number, line in enumerate(lockfile.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.fullmatch(line)
        if match is None:
            raise SystemExit(f"{lockfile}:{number}: expected a pinned requirement name==version, got {line[:80]!r}")
        found.append((match["name"], match["version"]))
    return found


def registry_only(index: str) -> str:
    """The egress policy for an install: the index's address and port, nothing else."""
    parts = urlsplit(index)
    return f"version: 1\nallow:\n  - cidr: {parts.hostname}/32\n    ports: [{parts.port or 80}]\n"


def audit_one(service: Service, name: str, version: str, index: str, policy: str,
              advisories: dict[str, dict[str, str]]) -> dict[str, object]:
    host = urlsplit(index).hostname or ""
    install = (f"PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --disable-pip-version-check --no-cache-dir "
               f"--no-build-isolation --retries 0 --timeout 10 --progress-bar off --target /tmp/site "
               f"--index-url {shlex.quote(index)} --trusted-host {shlex.quote(host)} "
               f"{shlex.quote(f'{name}=={version}')} 2>&1")
    with Sandbox.create(policy=policy, ttl_seconds=900, service=service) as sbx:
        result = sbx.exec(install, timeout=600, cwd="/")
        listed = sbx.exec("python3 -m pip list --disable-pip-version-check --format=json --path /tmp/site",
                          timeout=120, cwd="/")
        blocked = [*result.blocked_egress, *listed.blocked_egress]
        report: dict[str, object] = {"sandbox": sbx.id, "exit_code": result.exit_code}
    installed = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout or b"[]")} if listed.exit_code == 0 \
        else {}
    refused = sorted({f"{b.dest}:{b.port}" for b in blocked})
    found = {pkg: advisories[pkg][ver] for pkg, ver in installed.items() if ver in advisories.get(pkg, {})}
    verdict = "hostile" if refused else "failed" if result.exit_code != 0 else "vulnerable" if found else "ok"
    report.update(installed=installed, refused_egress=refused, advisories=found, verdict=verdict,
                  output_tail=result.stdout.decode("utf-8", "replace")[-2000:])
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lockfile", type=Path, required=True)
    parser.add_argument("--index", required=True, help="the package index's simple URL (http://HOST:PORT/simple)")
    parser.add_argument("--advisories", type=Path, required=True)
    parser.add_argument("--policy", type=Path, help="egress policy YAML (default: the index's address only)")
    parser.add_argument("--socket", help="the service's socket (default: $MICROVM_CHECK_SOCKET or the default)")
    args = parser.parse_args()
    service = Service(socket=args.socket) if args.socket else Service.from_env()
    policy = args.policy.read_text() if args.policy else registry_only(args.index)
    advisories = {k.lower(): v for k, v in json.loads(args.advisories.read_text()).items()}
    reports = {f"{name}=={version}": audit_one(service, name, version, args.index, policy, advisories)
               for name, version in pins(args.lockfile)}
    print(json.dumps(reports, indent=2))
    return 0 if all(r["verdict"] == "ok" for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
