"""The job service: one fresh VM per job, driven over a local HTTP API.

Entry points: `JobService` (service.py) runs jobs and implements the GitHub webhook's `JobHooks`;
`ApiServers` (listeners.py) serves it on a Unix socket (and optional TCP), its routes
split by resource (api.py says where); `runner.jobapi` holds the API's
contract and the client the action and `microvm-check run` use. The API is described in docs/job-api.md.
"""
