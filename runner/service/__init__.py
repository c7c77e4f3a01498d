"""The job service: one fresh VM per job, driven over a local HTTP API.

Four wings by role and the configuration under them, each importing only the ones below it
(pyproject.toml's import-linter contract "The service's wings"):

- `host/`: assembly: `ServiceHost` builds the service, its listeners, GitHub side, fleet and VMs in one
  order and takes them apart again; the `serve`/`jobs`/`config` commands; retention.
- `api/`: HTTP: the listeners, what is decided on a request's head, the path table, the job, sandbox,
  terminal and page routes, the metrics, and `refusals.STATUS` (the one table from errors to statuses).
- `github/`: GitHub: the runner desk, what the service does when GitHub speaks, check runs, the App.
- `jobs/`: a job: admission, the queue, workers, one job's life in a VM, sessions, warm bases,
  sandboxes, records, logs, outputs, secrets, signed records.
- `config/`: the service's YAML configuration as typed settings, read by every wing.

`runner.jobapi` holds the API's contract and the client the action and `microvm-check run` use; the API
is described in docs/job-api.md.
"""
