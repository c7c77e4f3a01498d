"""What another job's process on the host could try on the job API: run as the runner user, it reads
a list of requests (JSON on argv[1]) and prints one JSON line per request with the service's answer.

It uses the job API client with whatever credentials its environment holds (the runner's token from
MICROVM_CHECK_RUNNER_TOKEN, as the action does) and, per request, an optional job token. Requests:
["list"], ["health"], ["submit", SPEC], ["get" | "cancel" | "logs" | "artifacts" | "upload", JOB_ID, JOB_TOKEN or null].
"""

from __future__ import annotations

import io
import json
import os
import sys

from runner.jobapi.client import JobAPIError, JobClient


def attempt(client: JobClient, request: list) -> dict:
    op, *args = request
    if len(args) == 2 and args[1]:
        client.job_tokens[args[0]] = args[1]
    try:
        if op == "list":
            client.list()
        elif op == "health":
            return {"op": op, "status": 200, "health": client.health().to_wire()}
        elif op == "submit":
            summary = client.submit(args[0])
            return {"op": op, "status": 201, "id": summary.id, "token": summary.token}
        elif op == "get":
            client.get(args[0])
        elif op == "cancel":
            client.cancel(args[0])
        elif op == "logs":
            next(iter(client.logs(args[0], reconnects=0)), None)
        elif op == "artifacts":
            client.artifacts(args[0], io.BytesIO())
        elif op == "upload":
            client.upload_checkout(args[0], b"\0" * 1024)
        else:
            raise ValueError(f"unknown request {op}")
    except JobAPIError as exc:
        return {"op": op, "status": exc.status, "error": str(exc)}
    finally:
        client.job_tokens.clear()
    return {"op": op, "status": 200}


def main() -> int:
    requests = json.loads(sys.argv[1])
    socket = sys.argv[2]
    with JobClient(socket=socket, runner_token=os.environ.get("MICROVM_CHECK_RUNNER_TOKEN") or None) as client:
        for request in requests:
            print("probe " + json.dumps(attempt(client, request)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
