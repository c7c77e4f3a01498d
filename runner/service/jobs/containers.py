"""A job's service containers (the action's `services:`) as the guest shell script that runs its command.

The script is made here, on the host, from the validated spec (every value shell-quoted), and runs in
the job's VM like the command itself: it starts each service (`docker build` of its directory of the
checkout, or its image, pulled through the job's egress policy unless the VM has it), follows its log
into the job log with a `[name] ` prefix, waits for its `ready` command, then runs the command, and
removes the services when the command ends, whatever its exit. Nothing of it runs on the host.

Exit codes: the command's own; SERVICES_FAILED when a service cannot be started or never gets ready,
with a line saying which and why (its state and last log lines are in the log just above).
"""

from __future__ import annotations

import shlex

from runner.jobapi.contract import ServiceContainer

SERVICES_FAILED = 125  # docker's own code for "the container could not be started"
SAY = "microvm-check services:"


def _prefix(name: str) -> str:
    return f"mvc-service-{name}"


def _start(service: ServiceContainer) -> list[str]:
    q = shlex.quote
    container = _prefix(service.name)
    image = q(service.image) if service.image else q(f"{container}:job")
    lines = [f"echo {q(f'{SAY} starting {service.name} from ' + (service.image or 'build ' + str(service.build)))} >&2"]
    if service.build:
        lines.append(f"docker build -q -t {image} {q(service.build)} >/dev/null "
                     f"|| mvc_fail {q(f'{service.name}: docker build of {service.build} failed (see above)')}")
    run = ["docker", "run", "-d", "--name", q(container)]
    for key, value in service.env.items():
        run += ["-e", q(f"{key}={value}")]
    for port in service.ports:
        run += ["-p", q(f"127.0.0.1:{port}" if ":" in port else f"127.0.0.1:{port}:{port}")]
    lines.append(" ".join([*run, image]) + " >/dev/null "
                 f"|| mvc_fail {q(f'{service.name}: docker run of {service.image or service.build} failed (see above)')}")
    # Its log into the job's, line by line with its name in front, until the container is removed.
    lines.append(f"(docker logs -f {q(container)} 2>&1 | sed -u {q(f's/^/[{service.name}] /')}) &")
    return lines


def _wait_ready(service: ServiceContainer) -> list[str]:
    if service.ready is None:
        return []
    q = shlex.quote
    timeout = service.ready_timeout_seconds
    never = (f"{service.name} never got ready: its ready command {service.ready!r} did not succeed within "
             f"{timeout} s")
    return [
        f"mvc_deadline=$(( $(date +%s) + {timeout} ))",
        f"until sh -c {q(service.ready)} >/dev/null 2>&1; do",
        "    if [ \"$(date +%s)\" -ge \"$mvc_deadline\" ]; then",
        f"        docker logs --tail 20 {q(_prefix(service.name))} 2>&1 | sed {q(f's/^/[{service.name}] /')}",
        f"        mvc_fail {q(never + '; the container is ')}\"$(docker inspect -f '{{{{.State.Status}}}}' "
        f"{q(_prefix(service.name))} 2>&1)\"",
        "    fi",
        "    sleep 0.5",
        "done",
        f"echo {q(f'{SAY} {service.name} is ready')} >&2",
    ]


def script(services: tuple[ServiceContainer, ...], command: str) -> str:
    """The guest script: the services up and ready, then `command` (by `sh -c`), then the services gone."""
    q = shlex.quote
    names = " ".join(q(_prefix(s.name)) for s in services)
    lines = [
        f"mvc_fail() {{ echo \"{SAY} $1\" >&2; exit {SERVICES_FAILED}; }}",
        f"mvc_down() {{ docker rm -f -v {names} >/dev/null 2>&1; }}",
        "trap mvc_down EXIT",
        "trap 'exit 143' TERM INT HUP",
        "command -v docker >/dev/null || mvc_fail 'services need Docker in the VM: use the docker template "
        "(template: docker)'",
    ]
    for service in services:
        lines += _start(service)
    for service in services:
        lines += _wait_ready(service)
    lines += [f"sh -c {q(command)}"]
    return "\n".join(lines) + "\n"
